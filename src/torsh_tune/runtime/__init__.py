"""Code that runs inside each rank: bootstrap, patches, step budget, clean shutdown."""
