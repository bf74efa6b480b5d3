"""`moerun launch` with real daemon processes: it starts the daemons of a config, runs the
workload through them, names a daemon that fails to start with its stderr, and never leaves
a daemon behind, even when the launch itself is killed."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.gguf.chat import render_messages
from moerun.writers.demo import demo_model_path
from tests.support.live_processes import child_pids, exited, free_port, healthy
from tests.support.shm_segments import shm_segments

EXIT_WITHIN_S = 20.0                 # a wait that ends once they are gone
START_WITHIN_S = 60.0


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rig.toml"
    path.write_text(f'model = "{demo_model_path()}"\nctx = 128\nhot = 1\n{body}')
    return path


def greedy_text(prompt: str, n: int) -> str:
    with Runtime(demo_model_path(), ctx=128) as runtime:
        ids = runtime.tokenizer.encode(prompt)
        return runtime.tokenizer.decode(list(runtime.generate(ids, n, SamplingParams(temperature=0.0),
                                                              runtime.tokenizer.stop_ids)))


GENERATE = '[generate]\nprompt = "The rig"\nn_predict = 12\ntemp = 0.0\n'


def test_launch_starts_the_daemons_and_generates_through_them(moerun, tmp_path):
    own_socket = tmp_path / "sockets" / "own.sock"
    config = write_config(tmp_path, f"""workload = "generate"
[[daemon]]
device = "cpu"
[[daemon]]
name = "own"
device = "cpu"
endpoint = "ipc://{own_socket}"
{GENERATE}stats_json = "stats.json"
""")
    result = moerun("launch", "--config", config)
    assert result.exit_code == 0, result.output
    assert result.stdout == greedy_text("The rig", 12) + "\n"
    daemons = json.loads((tmp_path / "stats.json").read_text())["daemons"]
    assert [daemon["endpoint"] for daemon in daemons][1] == f"ipc://{own_socket}"
    assert all(daemon["calls"] > 0 and daemon["state"] == "up" for daemon in daemons)
    assert not own_socket.parent.exists()       # made by launch for the socket, removed at its end


def test_launch_starts_the_layer_shards_with_their_layers_and_context(moerun, tmp_path):
    """[[split]] with a device and an endpoint: started here as `moerun daemon --layers A:B --ctx N`
    (A:B from its layer to the next table's), one with a device only spawned by the parent."""
    own_socket = tmp_path / "sockets" / "shard.sock"
    config = write_config(tmp_path, f"""workload = "generate"
[[split]]
name = "own"
device = "cpu"
endpoint = "ipc://{own_socket}"
layer = 1
[[split]]
device = "cpu"
layer = 3
{GENERATE}stats_json = "stats.json"
""")
    result = moerun("launch", "--config", config)
    assert result.exit_code == 0, result.output
    assert result.stdout == greedy_text("The rig", 12) + "\n"
    shards = json.loads((tmp_path / "stats.json").read_text())["daemons"]
    assert [(shard["endpoint"], shard["layers"]) for shard in shards][0] == (f"ipc://{own_socket}", [1, 3])
    assert [shard["layers"] for shard in shards][1] == [3, 4]
    assert all(shard["calls"] > 0 and shard["state"] == "up" for shard in shards)


def test_flags_after_the_config_go_to_the_workload_and_override_the_file(moerun, tmp_path):
    blocker = tmp_path / "taken.sock"
    blocker.write_text("not a socket")
    config = write_config(tmp_path, f'[[daemon]]\nname = "never"\ndevice = "cpu"\nendpoint = "ipc://{blocker}"\n'
                                    f'{GENERATE}')
    result = moerun("launch", "--config", config, "--daemon", "cpu", "-n", "4")
    assert result.exit_code == 0, result.output       # the file's daemon was replaced, so never started
    assert result.stdout == greedy_text("The rig", 4) + "\n"


def test_a_started_daemon_that_never_listens_is_named_with_its_stderr(moerun, tmp_path):
    blocker = tmp_path / "taken.sock"
    blocker.write_text("not a socket")
    config = write_config(tmp_path, f'[[daemon]]\nname = "blocked"\ndevice = "cpu"\nendpoint = "ipc://{blocker}"\n'
                                    f'{GENERATE}')
    started = time.monotonic()
    result = moerun("launch", "--config", config)
    assert result.exit_code == 1
    assert time.monotonic() - started < START_WITHIN_S
    first, *stderr_tail = result.stderr.strip().splitlines()
    assert first == (f"Error: daemon blocked (cpu on ipc://{blocker}) exited while starting (status 1); "
                     f"the end of its stderr:")
    assert any(f"{blocker} exists and is not a socket" in line for line in stderr_tail)


def test_a_spawned_daemon_on_a_device_this_machine_lacks_is_refused_in_one_line(moerun, tmp_path):
    config = write_config(tmp_path, f'[[daemon]]\ndevice = "cuda:99"\n{GENERATE}')
    result = moerun("launch", "--config", config)
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith("Error: --daemon cuda:99 ")
    assert "CuPy" in errors[0] or "device" in errors[0]          # what is missing: CuPy, or the GPU


# -- the launch process as users run it ---------------------------------------------------------

def read_line(process: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    assert ready, "no output in time"
    return process.stdout.readline()


def test_killing_the_launch_kills_its_daemons_and_leaves_no_shared_memory(tmp_path):
    own_socket = tmp_path / "own.sock"
    config = write_config(tmp_path, f"""transport = "shared"
[[daemon]]
device = "cpu"
[[daemon]]
name = "own"
device = "cpu"
endpoint = "ipc://{own_socket}"
[generate]
chat = true
n_predict = 4
temp = 0.0
""")
    segments_before = shm_segments()
    process = subprocess.Popen([sys.executable, "-m", "moerun", "launch", "--config", str(config)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        process.stdin.write("hello\n")
        process.stdin.flush()
        read_line(process, START_WITHIN_S)             # one chat turn answered: both daemons at work
        daemons = child_pids(process.pid)
        assert len(daemons) == 2 and own_socket.exists()
        process.send_signal(signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + EXIT_WITHIN_S
        while not all(exited(pid) for pid in daemons) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(exited(pid) for pid in daemons)
        assert not own_socket.exists()
        assert shm_segments() <= segments_before
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_started_daemon_that_dies_is_started_again_and_rejoins(tmp_path):
    own_socket = tmp_path / "own.sock"
    config = write_config(tmp_path, f"""daemon_timeout = 2
[[daemon]]
name = "own"
device = "cpu"
endpoint = "ipc://{own_socket}"
[generate]
chat = true
n_predict = 6
temp = 0.0
stats_json = "stats.json"
""")
    process = subprocess.Popen([sys.executable, "-m", "moerun", "launch", "--config", str(config)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    try:
        process.stdin.write("hello\n")
        process.stdin.flush()
        replies = [read_line(process, START_WITHIN_S)]
        (first,) = child_pids(process.pid)
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: next(iter(child_pids(process.pid) - {first}), None), process, stderr)
        process.stdin.write("again\n")                   # its first call finds the new daemon without experts
        process.stdin.flush()
        replies.append(read_line(process, START_WITHIN_S))
        wait_for(lambda: any("rejoined" in line for line in stderr), process, stderr)
        process.stdin.close()
        assert process.wait(START_WITHIN_S) == 0, "".join(stderr)
    finally:
        process.kill()
        process.wait()
    assert second != first
    assert f"daemon own (cpu on ipc://{own_socket}) exited with status -9" in "".join(stderr)
    (daemon,) = json.loads((tmp_path / "stats.json").read_text())["daemons"]
    assert daemon["rejoins"] == 1 and daemon["fallback_calls"] > 0 and daemon["state"] == "up"
    assert replies == [reply + "\n" for reply in chat_replies(["hello", "again"], 6)]


def wait_for(condition, process: subprocess.Popen, stderr: list[str]):
    deadline = time.monotonic() + START_WITHIN_S
    while not (result := condition()):
        assert time.monotonic() < deadline and process.poll() is None, "".join(stderr)
        time.sleep(0.05)
    return result


def chat_replies(turns: list[str], n: int) -> list[str]:
    """Greedy replies of the demo model to a conversation, as `moerun run --chat` holds it."""
    replies, messages = [], []
    with Runtime(demo_model_path(), ctx=128) as runtime:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            ids = runtime.tokenizer.encode(render_messages(runtime.tokenizer, messages))
            tokens = list(runtime.generate(ids, n, SamplingParams(temperature=0.0), runtime.tokenizer.stop_ids))
            replies.append(runtime.tokenizer.decode(tokens))
            messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_launch_serves_with_the_files_server_settings(tmp_path):
    port = free_port()
    config = write_config(tmp_path, f"""workload = "serve"
[[daemon]]
device = "cpu"
[server]
port = {port}
served_model_name = "rig-model"
""")
    log = tmp_path / "launch.log"
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "moerun", "launch", "--config", str(config)],
                                   stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while not healthy(url):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        daemons = child_pids(process.pid)
        assert len(daemons) == 1
        assert [model["id"] for model in httpx.get(f"{url}/v1/models").json()["data"]] == ["rig-model"]
        reply = httpx.post(f"{url}/v1/completions", json={"model": "rig-model", "prompt": "The rig",
                                                          "max_tokens": 12, "temperature": 0}, timeout=30)
        assert reply.json()["choices"][0]["text"] == greedy_text("The rig", 12)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 128 + signal.SIGTERM          # the orderly way out, as systemd stops it
        assert all(exited(pid) for pid in daemons)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_launch_needs_a_config(moerun):
    result = moerun("launch")
    assert result.exit_code == 2 and "Missing option '--config'" in result.stderr


def test_child_pids_sees_only_live_children(tmp_path):
    """The helper the kill test relies on: it finds a child and tells when it is gone."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid()) and not exited(child.pid)
    finally:
        child.kill()
        child.wait()
    assert exited(child.pid)
