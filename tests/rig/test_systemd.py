"""`moerun systemd`: units that share /run/moerun and /dev/shm, pin each daemon to its device,
give CPU daemons their share of the host's CPUs, order the parent after its local daemons, and
pass `systemd-analyze verify`."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_SETTINGS = ["Restart=on-failure", "RuntimeDirectory=moerun", "RuntimeDirectoryPreserve=yes", "PrivateTmp=no",
                   "RemoveIPC=no", "LimitMEMLOCK=infinity"]

RIG = """
model = "models/rig.gguf"
device = "hip:0"
workload = "serve"

[auth]
client_secret_key = "/keys/parent.key_secret"

[[daemon]]
name = "nvidia"
device = "cuda:1"
endpoint = "ipc:///run/moerun/nvidia.sock"

[[daemon]]
name = "radeon"
device = "hip:2"
endpoint = "ipc:///run/moerun/radeon.sock"

[[daemon]]
name = "far"
host = "gpu-box-2"
device = "cpu"
endpoint = "tcp://gpu-box-2:7070"
listen = "tcp://0.0.0.0:7070"
curve_public_key = "/keys/far.key"
curve_secret_key = "/keys/far.key_secret"
curve_authorized_keys = "/keys/parents"
"""


@pytest.fixture
def units(moerun, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text(RIG)
    out = tmp_path / "units"
    result = moerun("systemd", "--config", config, "-o", out)
    assert result.exit_code == 0, result.output
    return out


def settings(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_it_writes_a_template_an_environment_per_daemon_and_the_parent(units):
    assert sorted(str(path.relative_to(units)) for path in units.rglob("*") if path.is_file()) == [
        "moerun-daemon-far.env", "moerun-daemon-nvidia.env", "moerun-daemon-radeon.env",
        "moerun-daemon@.service", "moerun-daemon@radeon.service.d/gpu-groups.conf", "moerun.service"]


def test_every_unit_shares_the_runtime_directory_and_shared_memory(units):
    for name in ("moerun-daemon@.service", "moerun.service"):
        lines = settings(units / name)
        assert all(setting in lines for setting in SHARED_SETTINGS), name
        assert "WantedBy=multi-user.target" in lines


def test_the_template_runs_the_daemon_from_its_environment_file(units):
    lines = settings(units / "moerun-daemon@.service")
    assert "EnvironmentFile=/etc/moerun/moerun-daemon-%i.env" in lines
    assert f"ExecStart={sys.executable} -m moerun daemon --model ${{MOERUN_MODEL}} --device ${{MOERUN_DEVICE}} " \
           f"--listen ${{MOERUN_LISTEN}} $MOERUN_CURVE_FLAGS $MOERUN_CPU_FLAGS $MOERUN_SHARD_FLAGS" in lines


def test_environment_files_pin_each_daemon_to_its_device(units, tmp_path):
    model = f'MOERUN_MODEL="{tmp_path / "models" / "rig.gguf"}"'
    assert settings(units / "moerun-daemon-nvidia.env") == [
        model, 'MOERUN_DEVICE="cuda:0"', 'MOERUN_LISTEN="ipc:///run/moerun/nvidia.sock"', 'CUDA_VISIBLE_DEVICES="1"']
    assert settings(units / "moerun-daemon-radeon.env") == [
        model, 'MOERUN_DEVICE="hip:0"', 'MOERUN_LISTEN="ipc:///run/moerun/radeon.sock"',
        'HIP_VISIBLE_DEVICES="2"', 'ROCR_VISIBLE_DEVICES="2"']
    assert settings(units / "moerun-daemon-far.env") == [
        model, 'MOERUN_DEVICE="cpu"', 'MOERUN_LISTEN="tcp://0.0.0.0:7070"',
        'MOERUN_CURVE_FLAGS="--curve-secret-key /keys/far.key_secret --curve-authorized-keys /keys/parents"']


CPU_RIG = """
model = "m.gguf"
device = "cuda:0"
pin = true

[[daemon]]
name = "given"
device = "cpu"
endpoint = "ipc:///run/moerun/given.sock"
threads = 3

[[daemon]]
name = "shared"
device = "cpu"
endpoint = "ipc:///run/moerun/shared.sock"

[[daemon]]
name = "far"
host = "cpu-box-2"
device = "cpu"
endpoint = "tcp://cpu-box-2:7070"
threads = 8
numa_node = 1
"""


def test_cpu_daemons_get_their_share_of_this_host_and_pinned_cpus(moerun, tmp_path, monkeypatch):
    monkeypatch.setattr("moerun.rig.cores.usable_cpus", lambda: set(range(16)))
    config = tmp_path / "rig.toml"
    config.write_text(CPU_RIG)
    out = tmp_path / "units"
    assert moerun("systemd", "--config", config, "-o", out).exit_code == 0
    blas = ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"]
    # 16 CPUs: the GPU parent 1, "given" the 3 it asks for, "shared" the other 12
    for name, threads, cpus in (("given", 3, "1-3"), ("shared", 12, "4-15")):
        lines = settings(out / f"moerun-daemon-{name}.env")
        assert f'MOERUN_CPU_FLAGS="--threads {threads}"' in lines
        assert all(f'{variable}="{threads}"' in lines for variable in blas)
        assert settings(out / f"moerun-daemon@{name}.service.d" / "cpus.conf") == ["[Service]", f"CPUAffinity={cpus}"]
    far = settings(out / "moerun-daemon-far.env")      # another host: its own count and node, no pinning here
    assert 'MOERUN_CPU_FLAGS="--threads 8 --numa-node 1"' in far
    assert not (out / "moerun-daemon@far.service.d").exists()


def test_without_pin_cpu_daemons_get_counts_and_no_affinity(moerun, tmp_path, monkeypatch):
    monkeypatch.setattr("moerun.rig.cores.usable_cpus", lambda: set(range(16)))
    config = tmp_path / "rig.toml"
    config.write_text(CPU_RIG.replace("pin = true\n", ""))
    out = tmp_path / "units"
    assert moerun("systemd", "--config", config, "-o", out).exit_code == 0
    assert 'MOERUN_CPU_FLAGS="--threads 12"' in settings(out / "moerun-daemon-shared.env")
    assert not list(out.glob("*.service.d"))


def test_amd_devices_get_the_render_and_video_groups(units):
    assert settings(units / "moerun-daemon@radeon.service.d" / "gpu-groups.conf") == [
        "[Service]", "SupplementaryGroups=render video"]
    assert "SupplementaryGroups=render video" in settings(units / "moerun.service")       # a hip:0 parent
    assert "SupplementaryGroups=render video" not in settings(units / "moerun-daemon@.service")


def test_the_parent_waits_for_its_local_daemons_and_runs_the_workload(units, tmp_path):
    lines = settings(units / "moerun.service")
    local = "moerun-daemon@nvidia.service moerun-daemon@radeon.service"
    assert f"Wants={local}" in lines and f"After={local}" in lines
    assert "Wants=network-online.target" in lines and "After=network-online.target" in lines
    assert not any("moerun-daemon@far" in line for line in lines)      # it runs on gpu-box-2
    assert f"ExecStart={sys.executable} -m moerun serve --config {tmp_path / 'rig.toml'}" in lines
    assert "SuccessExitStatus=143" in lines


def test_layer_shards_run_from_the_template_with_their_layers_and_context(moerun, tmp_path):
    from moerun.writers.demo import demo_model_path
    config = tmp_path / "rig.toml"
    config.write_text(f"""model = "{demo_model_path()}"
ctx = 256
[[daemon]]
name = "experts"
device = "cpu"
endpoint = "ipc:///run/moerun/experts.sock"
[[split]]
name = "upper"
device = "cuda:1"
endpoint = "ipc:///run/moerun/upper.sock"
layer = 2
""")
    out = tmp_path / "units"
    result = moerun("systemd", "--config", config, "-o", out)
    assert result.exit_code == 0, result.output
    assert settings(out / "moerun-daemon-upper.env") == [
        f'MOERUN_MODEL="{demo_model_path()}"', 'MOERUN_DEVICE="cuda:0"', 'MOERUN_LISTEN="ipc:///run/moerun/upper.sock"',
        'CUDA_VISIBLE_DEVICES="1"', 'MOERUN_SHARD_FLAGS="--layers 2:4 --ctx 256"']
    local = "moerun-daemon@experts.service moerun-daemon@upper.service"
    assert f"Wants={local}" in settings(out / "moerun.service")


@pytest.mark.parametrize("split,message", [
    ('device = "cuda:1"\nlayer = 2\n', "[[split]] s0 needs a device and an endpoint to run as a unit"),
    ('name = "d0"\ndevice = "cuda:1"\nendpoint = "ipc:///run/moerun/s.sock"\nlayer = 2\n',
     "[[split]] d0: another daemon or shard has that name"),
], ids=["no endpoint", "a daemon's name"])
def test_a_shard_a_unit_cannot_run_is_an_error(moerun, tmp_path, split, message):
    config = tmp_path / "rig.toml"
    config.write_text(f'model = "m.gguf"\n[[daemon]]\ndevice = "cpu"\nendpoint = "ipc:///run/moerun/d.sock"\n'
                      f'[[split]]\n{split}')
    result = moerun("systemd", "--config", config, "-o", tmp_path / "units")
    assert result.exit_code == 1
    assert message in result.stderr


def test_user_runs_every_unit_as_that_user(moerun, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text('model = "m.gguf"\n[[daemon]]\ndevice = "cpu"\nendpoint = "ipc:///run/moerun/d0.sock"\n')
    assert moerun("systemd", "--config", config, "-o", tmp_path / "u", "--user", "moerun").exit_code == 0
    for name in ("moerun-daemon@.service", "moerun.service"):
        assert "User=moerun" in settings(tmp_path / "u" / name)


def test_exec_start_quotes_paths_with_spaces_and_escapes_specifiers(moerun, tmp_path):
    folder = tmp_path / "my rigs 100%"
    folder.mkdir()
    config = folder / "rig.toml"
    config.write_text('model = "m.gguf"\n')
    assert moerun("systemd", "--config", config, "-o", tmp_path / "u").exit_code == 0
    escaped = str(config).replace("%", "%%")
    unit = settings(tmp_path / "u" / "moerun.service")
    assert f'ExecStart={sys.executable} -m moerun run --config "{escaped}"' in unit


@pytest.mark.parametrize("text,message", [
    ('[[daemon]]\ndevice = "cpu"\n', "[[daemon]] d0 needs a device and an endpoint to run as a unit"),
    ('[[daemon]]\nendpoint = "ipc:///run/moerun/x.sock"\n', "[[daemon]] d0 needs a device and an endpoint"),
    ('model = "m.gguf"\n[[daemon]]\ndevice = "cpu"\nendpoint = "tcp://h:1"\ncurve_secret_key = "a b"\n'
     'curve_authorized_keys = "c"\n', "CURVE key paths in a unit cannot contain whitespace"),
])
def test_what_a_unit_cannot_run_is_an_error(moerun, tmp_path, text, message):
    config = tmp_path / "rig.toml"
    config.write_text(text if text.startswith("model") else 'model = "m.gguf"\n' + text)
    result = moerun("systemd", "--config", config, "-o", tmp_path / "u")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {config}: ") and message in result.stderr
    assert not (tmp_path / "u").exists()


def test_units_need_a_model(moerun, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text("ctx = 64\n")
    result = moerun("systemd", "--config", config, "-o", tmp_path / "u")
    assert result.exit_code == 1 and result.stderr.strip() == f"Error: {config}: systemd units need `model`"


BROKEN_RIG = """\
# a rig for units
ctx = 0
hot = 2
placement = "auto"
server = 3

[generate]
temp = -1
seed = 4294967296

[[daemon]]
name = "gpu"
device = "cuda:1"

[[daemon]]
devcie = "cpu"

[[daemon]]
name = "gpu"
device = "cpu"
endpoint = "tcp://h:1"
curve_secret_key = "my key"
curve_authorized_keys = "parents"
"""


def test_every_problem_of_a_config_is_one_error(moerun, tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text(BROKEN_RIG)
    result = moerun("systemd", "--config", config, "-o", tmp_path / "u")
    assert result.exit_code == 1
    assert result.stderr.count("Error:") == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"Error: {config}: {message}" if n == 0 else f"{config}{message}"
                                                  for n, message in enumerate([
        "systemd units need `model`",
        ", line 2: ctx = 0: must be >= 1",
        ", line 4: give hot or placement, not both",
        ", line 5: server must be a table ([server])",
        ", line 8: temp = -1: must be >= 0",
        ", line 9: seed = 4294967296: must be between 0 and 4294967295",
        ': [[daemon]] gpu needs a device and an endpoint to run as a unit '
        '(e.g. endpoint = "ipc:///run/moerun/gpu.sock")',
        ': [[daemon]] d1 needs a device and an endpoint to run as a unit '
        '(e.g. endpoint = "ipc:///run/moerun/d1.sock")',
        ", line 16: unknown key 'devcie' in [[daemon]] (did you mean 'device'?)",
        ": [[daemon]] gpu: CURVE key paths in a unit cannot contain whitespace",
        ", line 19: two [[daemon]] tables are named 'gpu'",
    ])]
    assert not (tmp_path / "u").exists()


def test_every_problem_of_a_config_is_one_error_from_the_installed_command(tmp_path):
    config = tmp_path / "rig.toml"
    config.write_text('ctx = 0\n[[daemon]]\ndevice = "cpu"\n')
    result = subprocess.run([sys.executable, "-m", "moerun", "systemd", "--config", str(config),
                             "-o", str(tmp_path / "u")], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: {config}: systemd units need `model`",
        f"{config}, line 1: ctx = 0: must be >= 1",
        f'{config}: [[daemon]] d0 needs a device and an endpoint to run as a unit '
        f'(e.g. endpoint = "ipc:///run/moerun/d0.sock")']


@pytest.mark.parametrize("text,message", [
    ('modl = "m.gguf"\n', "line 1: unknown key 'modl' (did you mean 'model'?)"),
    ('model = 3\n', "line 1: model = 3: must be a non-empty string"),
    ('model = "m.gguf"\n[[daemon]]\ndevice = "cpu"\nendpoint = "tcp://h"\n',
     "line 4: endpoint = 'tcp://h': must be ipc://PATH or tcp://HOST:PORT"),
])
def test_a_key_the_reader_reported_is_not_reported_again_for_units(moerun, tmp_path, text, message):
    config = tmp_path / "rig.toml"
    config.write_text(text)
    result = moerun("systemd", "--config", config, "-o", tmp_path / "u")
    assert result.exit_code == 1 and result.stderr.strip() == f"Error: {config}, {message}"


@pytest.mark.tools
@pytest.mark.parametrize("example", [None, "cuda-parent-hip-daemons.toml", "two-hosts.toml"],
                         ids=lambda name: name or "mixed-rig")
def test_generated_units_pass_systemd_analyze_verify(moerun, tmp_path, example):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    config = REPO / "configs" / example if example else tmp_path / "rig.toml"
    if example is None:
        config.write_text(RIG)
    out = tmp_path / "units"
    assert moerun("systemd", "--config", config, "-o", out, "--user", "moerun").exit_code == 0
    instances = [f"moerun-daemon@{path.name.removeprefix('moerun-daemon-').removesuffix('.env')}.service"
                 for path in out.glob("moerun-daemon-*.env")]
    assert instances
    result = subprocess.run([analyze, "verify", *(str(out / unit) for unit in ["moerun.service", *instances])],
                            capture_output=True, text=True)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "moerun" in line]
    assert result.returncode == 0 and complaints == [], result.stdout + result.stderr


@pytest.mark.parametrize("flags,message", [
    (["--env-dir", "etc/moerun"], "Invalid value for --env-dir: 'etc/moerun': systemd needs an absolute path"),
    (["--user", "root\nExecStartPre=/bin/evil"], "is not a user name"),
])
def test_unit_options_are_checked(moerun, tmp_path, flags, message):
    config = tmp_path / "rig.toml"
    config.write_text('model = "m.gguf"\n')
    result = moerun("systemd", "--config", config, "-o", tmp_path / "u", *flags)
    assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "u").exists()
