"""Two tuners on two emulated nodes share one study in a real PostgreSQL server.

Node 0 and node 1 are network namespaces joined by a shaped veth link (`launch.emulate`),
each with its own hostname. Debian's PostgreSQL runs on node 0, started here with `initdb`
and `pg_ctl` as an unprivileged user (postgres refuses root) on a private data directory;
the tuners reach it over TCP, node 1's across the link (the test itself reads the study
through the server's unix socket, which no namespace hides). The tuner on node 0 is killed
(SIGKILL) in the middle of a trial: its completed trials stay, the tuner on node 1 goes on
to the study's trial count, and node 0's tuner, started again, fails its orphaned trial as
stale. `make test` installs the server (`make postgres`); without it, root or iproute2 the
test is skipped with the reason.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest

from torsh_tune.launch.emulate import EmulatedCluster, EmulateSpec, node_address, node_hostname

SCRIPT = Path(__file__).parent / "scripts" / "train_tune.py"
SPACE = "[space.ddp.bucket_cap_mb]\nchoices = [25.0, 5.0, 10.0]\n[space.dataloader.num_workers]\nvalue = 0\n"
PORT = 5432  # inside node 0's own network namespace: nothing else listens there
USER = "nobody"
POSTGRES_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "the emulated nodes need root (network namespaces)"
    tools = [t for t in ("ip", "tc", "unshare", "runuser") if shutil.which(t) is None]
    if tools:
        return f"{', '.join(tools)} missing (iproute2, util-linux)"
    if not POSTGRES_BIN or not Path(POSTGRES_BIN[-1], "initdb").is_file():
        return "Debian's postgresql is not installed (make postgres, as root)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no PostgreSQL driver (pip install -e '.[postgres]')"
    return None


# `serial`: its emulated nodes must not meet another test's cluster (tests/launch/test_emulate.py counts them).
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


def _as_user(*cmd: str) -> list[str]:
    return ["runuser", "-u", USER, "--", *cmd]


def _on_node(cluster: EmulatedCluster, node: int, cmd: list[str]) -> list[str]:
    """`cmd` on emulated node `node`: its network namespace and a hostname of its own."""
    return ["ip", "netns", "exec", cluster.namespaces[node], "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', node_hostname(node), *cmd]


@pytest.fixture
def server(tmp_path):
    """(cluster, the tuners' URL, the test's URL through the unix socket) of a PostgreSQL on node 0."""
    bin_dir = Path(POSTGRES_BIN[-1])
    home = Path(tempfile.mkdtemp(prefix="torsh-pg-"))  # /tmp, not pytest's root-only tmp_path
    user = pwd.getpwnam(USER)
    password = secrets.token_hex(8)
    (home / "pw").write_text(password + "\n")
    (home / "sock").mkdir()
    for path in (home, home / "pw", home / "sock"):
        os.chown(path, user.pw_uid, user.pw_gid)
    cluster = EmulatedCluster(EmulateSpec.parse("nodes=2,procs_per_node=2,link=1gbit"))
    cluster.__enter__()
    data = home / "data"
    try:
        subprocess.run(_as_user(str(bin_dir / "initdb"), "-D", str(data), "-U", "tuner", "--pwfile", str(home / "pw"),
                                "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync", "-E", "UTF8"),
                       check=True, capture_output=True, cwd=home)
        with open(data / "pg_hba.conf", "a") as hba:  # the emulated nodes' subnet, with the password
            hba.write(f"host all all {node_address(0)}/24 scram-sha-256\n")
        options = shlex.join(["-k", str(home / "sock"), "-h", node_address(0), "-p", str(PORT), "-c", "fsync=off",
                              "-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
        start = ["ip", "netns", "exec", cluster.namespaces[0],
                 *_as_user(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(home / "log"), "-w", "-t", "60",
                           "-o", options, "start")]
        done = subprocess.run(start, capture_output=True, text=True, cwd=home)
        assert done.returncode == 0, done.stdout + done.stderr + (home / "log").read_text()
        yield (cluster, f"postgresql://tuner:{password}@{node_address(0)}:{PORT}/postgres",
               f"postgresql://tuner@/postgres?host={home / 'sock'}&port={PORT}", password)
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(_as_user(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"),
                           capture_output=True, cwd=home)
        for ns in cluster.namespaces:  # whatever this test started on the nodes
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-KILL", pid], capture_output=True)
        cluster.close()
        shutil.rmtree(home, ignore_errors=True)


def _tune(cluster: EmulatedCluster, node: int, url: str, root: Path, trials: int, *extra: str) -> list[str]:
    return _on_node(cluster, node, [
        sys.executable, "-m", "torsh_tune.cli", "tune", "--nproc-per-node", "2", "--steps", "3", "--warmup-steps", "1",
        "--trials", str(trials), "--baseline-repeats", "1", "--confirm-top", "0", "--sampler", "random",
        "--storage", url, "--space", str(root / "space.toml"), "--no-compression", "--quiet",
        "--runs-dir", str(root / f"node{node}"), *extra, str(SCRIPT)])


def _study(storage: optuna.storages.BaseStorage) -> optuna.Study | None:
    try:
        return optuna.load_study(study_name="torsh-tune", storage=storage)
    except KeyError:
        return None


def _trials(storage: optuna.storages.BaseStorage) -> list[optuna.trial.FrozenTrial]:
    study = _study(storage)
    return study.trials if study is not None else []


def _on(trials, node: int, state: str) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials if t.state.name == state and t.user_attrs.get("tuner", {}).get("host") == node_hostname(node)]


def _wait(what: str, check, proc: subprocess.Popen, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert proc.poll() is None, f"the tuner ended before {what}: {proc.communicate()[0][-3000:]}"
        time.sleep(0.3)
    raise AssertionError(f"no {what} in {timeout_s:.0f} s")


def test_two_nodes_share_a_postgres_study_and_survive_a_killed_tuner(server, tmp_path):
    cluster, url, local_url, password = server
    local = optuna.storages.RDBStorage(local_url)  # one connection pool for all the polling
    (tmp_path / "space.toml").write_text(SPACE)
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    first = subprocess.Popen(_tune(cluster, 0, url, tmp_path, 10, "--run-name", "study-a"), **popen)
    second = None
    try:
        _wait("a trial finished on node 0", lambda: _on(_trials(local), 0, "COMPLETE"), first)
        # node 1 joins (the study is to hold 2 finished trials); once both tuners are in the middle
        # of a trial, node 0's is killed
        second = subprocess.Popen(_tune(cluster, 1, url, tmp_path, 2, "--run-name", "study-b"), **popen)
        _wait("a trial running on each node",
              lambda: _on(_trials(local), 0, "RUNNING") and _on(_trials(local), 1, "RUNNING"), second)
        assert first.poll() is None
        first.kill()
        first.communicate()
        killed_at = time.time()
        before = {t.number: t.values for t in _on(_trials(local), 0, "COMPLETE")}
        orphan = [t.number for t in _on(_trials(local), 0, "RUNNING")]
        out_second = second.communicate(timeout=300)[0]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert second.returncode == 0, out_second[-3000:]
    trials = _trials(local)
    # nothing node 0 completed is lost; node 1 went on after the kill, to the study's count
    assert {t.number: t.values for t in trials if t.number in before} == before
    assert all(t.state.name == "COMPLETE" for t in trials if t.number in before)
    on_second = _on(trials, 1, "COMPLETE")
    assert on_second and max(t.datetime_complete.timestamp() for t in on_second) > killed_at - 1.0
    assert len([t for t in trials if t.state.name == "COMPLETE"]) >= 2
    assert [t.number for t in trials if t.state.name == "RUNNING"] == orphan and len(orphan) == 1
    # the second tuner reused node 0's baseline and recorded its storage without the password
    assert not (tmp_path / "node1" / "study-b" / "baseline").exists()
    result = json.loads((tmp_path / "node1" / "study-b" / "result.json").read_text())
    assert result["storage"] == url.replace(password, "***")
    assert password not in (tmp_path / "node1" / "study-b" / "result.json").read_text()

    # node 0's tuner, started again on its node, fails the trial it was killed in and keeps the rest
    finished = len([t for t in trials if t.state.name in ("COMPLETE", "FAIL")])
    again = subprocess.run(_tune(cluster, 0, url, tmp_path, finished, "--resume", str(tmp_path / "node0" / "study-a")),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    stale = {t.number: t for t in _trials(local)}[orphan[0]]
    assert stale.state.name == "FAIL" and stale.user_attrs["failure_reason"].startswith("stale"), stale
    assert {t.number: t.values for t in _trials(local) if t.number in before} == before
