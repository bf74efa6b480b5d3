"""Rig config files: every key checked, errors that name the key and its line, flags that
override the file, and the example configs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from moerun.backends.kv_types import KVTypes
from moerun.commands.options import runtime_options
from moerun.config import DAEMON, SPLIT, TABLES, TOP_LEVEL, key_lines, load_config_file
from moerun.engine.runtime import Runtime
from moerun.engine.sampler import SamplingParams
from moerun.rig.settings import ConfigError, DaemonEntry, RigConfig, parse_split
from moerun.units import parse_bytes
from moerun.writers.demo import demo_model_path

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "rig.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@click.command()
@click.option("-m", "--model", default=None)
@runtime_options
def show(model, **runtime_flags):
    """Print what a command decorated with runtime_options receives."""
    entries = [entry.name for entry in runtime_flags.pop("daemon_entries")]
    split_entries = [entry.name for entry in runtime_flags.pop("split_entries")]
    click.echo(json.dumps({"model": model, "entries": entries, "split_entries": split_entries, **runtime_flags}))


def shown(*args) -> dict:
    result = CliRunner().invoke(show, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- the example configs ------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_parses(path):
    values = load_config_file(path)
    assert values["workload"] in ("generate", "serve")
    entries = values["daemon_entries"]
    assert entries and values["daemons"] == tuple(entry.spec for entry in entries)
    RigConfig(daemons=values["daemons"], daemon_entries=entries, device=values.get("device", "cpu"),
              splits=tuple(parse_split(text) for text in values.get("splits", ())))


def test_the_named_example_configs_exist():
    names = {path.name for path in (REPO / "configs").glob("*.toml")}
    assert {"cpu-demo.toml", "single-gpu.toml", "two-gpu.toml", "cuda-parent-hip-daemons.toml",
            "two-hosts.toml"} <= names


def test_every_key_is_documented_with_its_flag():
    doc = (REPO / "docs" / "config.md").read_text()
    keys = [*TOP_LEVEL, *(key for table in TABLES.values() for key in table), *DAEMON, *SPLIT]
    missing = [key for key in keys if f"| `{key}` |" not in doc]
    assert missing == []
    for table in (*TABLES, "[daemon]", "[split]"):
        assert f"`[{table}]`" in doc


# -- errors name the key and its line -----------------------------------------------------------

TYPO_CASES = [
    ("ctx = 64\ntransprt = 'shared'\n", 2, "'transprt'", "'transport'"),
    ("ctx = 64\n\n[server]\nport = 1\nhots = 'x'\n", 5, "'hots' in [server]", "'host'"),
    ("[[daemon]]\ndevice = 'cpu'\n\n[[daemon]]\n# the second\ndevcie = 'cpu'\n", 6, "'devcie' in [[daemon]]",
     "'device'"),
    ("model = 'm.gguf'\n[servr]\nport = 1\n", 2, "'servr'", "'server'"),
    ("[generate]\nprompt = '''\nn_predicts = 1\n'''\nn_predicts = 3\n", 5, "'n_predicts' in [generate]",
     "'n_predict'"),
]


@pytest.mark.parametrize("text,line,named,suggested", TYPO_CASES)
def test_a_typo_is_an_error_naming_the_key_and_its_line(moerun, tmp_path, text, line, named, suggested):
    path = write(tmp_path, text)
    result = moerun("run", "--config", path)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"Error: {path}, line {line}: unknown key {named} "
                                     f"(did you mean {suggested}?)")


BAD_VALUES = [
    ("transport = 'fast'", 2, "transport = 'fast': must be one of auto, device, shared, stream"),
    ("batch_capacity = 5000", 2, "batch_capacity = 5000: must be between 1 and 4096"),
    ("daemon_timeout = 0", 2, "daemon_timeout = 0: must be > 0"),
    ("require_daemons = 'yes'", 2, "require_daemons = 'yes': must be true or false"),
    ("ctx = 1.5", 2, "ctx = 1.5: must be an integer"),
    ("hot = true", 2, "hot = True: must be an integer"),
    ("device = 'gpu0'", 2, "device = 'gpu0': must be cpu, cuda:N or hip:N"),
    ("memory = 'lots'", 2, "memory = 'lots': must be a size such as 24GiB, 512MiB or 64GB"),
    ("workload = 'train'", 2, "workload = 'train': must be one of generate, serve"),
    ("[server]\nport = 70000", 3, "port = 70000: must be between 0 and 65535"),
    ("[[daemon]]\ndevice = 'cuda'", 3, "device = 'cuda': must be cpu, cuda:N or hip:N"),
    ("[[daemon]]\nendpoint = 'tcp://host'", 3, "endpoint = 'tcp://host': must be ipc://PATH or tcp://HOST:PORT"),
    ("[[daemon]]\ndevice = 'cpu'\nname = 'a b'", 4, "name = 'a b': must be letters, digits, _ and - only"),
    ("server = 3", 2, "server must be a table ([server])"),
    ("[daemon]\ndevice = 'cpu'", 2, "daemon must be a list of [[daemon]] tables"),
    ("[generate]\ntemp = -0.5", 3, "temp = -0.5: must be >= 0"),
    ("[generate]\ntemp = nan", 3, "temp = nan: must be a number"),
    ("[generate]\ntop_p = 0", 3, "top_p = 0: must be > 0 and <= 1"),
    ("[generate]\ntop_p = 1.5", 3, "top_p = 1.5: must be > 0 and <= 1"),
    ("[generate]\nmin_p = -0.1", 3, "min_p = -0.1: must be between 0 and 1"),
    ("[generate]\nmin_p = 1.01", 3, "min_p = 1.01: must be between 0 and 1"),
    ("[generate]\nrepeat_penalty = 0", 3, "repeat_penalty = 0: must be > 0"),
    ("[generate]\nrepeat_penalty = -1.5", 3, "repeat_penalty = -1.5: must be > 0"),
    ("[generate]\nseed = -1", 3, "seed = -1: must be between 0 and 4294967295"),
    ("[generate]\nseed = 4294967296", 3, "seed = 4294967296: must be between 0 and 4294967295"),
    ("[generate]\nspec_type = 'eagle'", 3, "spec_type = 'eagle': must be one of none, ngram, draft, auto"),
    ("[server]\ndraft_max = 0", 3, "draft_max = 0: must be >= 1"),
    ("[server]\nmax_body = 'big'", 3, "max_body = 'big': must be a size such as 24GiB, 512MiB or 64GB"),
    ("[server]\nmax_body = 4096", 3, "max_body = 4096: must be a size such as 24GiB, 512MiB or 64GB"),
]


@pytest.mark.parametrize("text,line,message", BAD_VALUES)
def test_a_bad_value_is_an_error_naming_the_key_and_its_line(moerun, tmp_path, text, line, message):
    path = write(tmp_path, "# a rig\n" + text + "\n")
    result = moerun("run", "--config", path)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {path}, line {line}: {message}"


# the same values through `moerun run`'s flags: both refuse them before any model is loaded
FLAG_TWINS = [("temp", "-0.5"), ("top_p", "0"), ("top_p", "1.5"), ("min_p", "-0.1"), ("min_p", "1.01"),
              ("repeat_penalty", "0"), ("repeat_penalty", "-1.5"), ("seed", "-1"), ("seed", "4294967296")]


@pytest.mark.parametrize("key,value", FLAG_TWINS)
def test_generate_keys_refuse_what_their_flags_refuse(moerun, tmp_path, key, value):
    flag = moerun("run", f"--{key.replace('_', '-')}", value)
    assert flag.exit_code == 2 and "Invalid value for" in flag.stderr
    path = write(tmp_path, f"[generate]\n{key} = {value}\n")
    from_file = moerun("run", "--config", path)
    assert from_file.exit_code == 1
    assert from_file.stderr.startswith(f"Error: {path}, line 2: {key} = {value}: must be ")


def test_generate_keys_take_the_values_at_their_bounds(tmp_path):
    path = write(tmp_path, "[generate]\ntemp = 0\ntop_p = 1\nmin_p = 0\nrepeat_penalty = 0.01\nseed = 0\n")
    assert load_config_file(path) == {"temp": 0.0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 0.01, "seed": 0}
    path = write(tmp_path, "[generate]\ntemp = 2.5\ntop_p = 1e-9\nmin_p = 1\nseed = 4294967295\n")
    assert load_config_file(path) == {"temp": 2.5, "top_p": 1e-9, "min_p": 1.0, "seed": 2**32 - 1}


def test_max_body_is_the_size_as_the_flag_takes_it(tmp_path):
    values = load_config_file(write(tmp_path, '[server]\nmax_body = "4MiB"\nport = 9000\n'))
    assert values == {"max_body": "4MiB", "port": 9000}
    assert parse_bytes(values["max_body"], "--max-body") == 4 * 2**20


RULES = [
    ("hot = 2\nplacement = 'auto'\n", 3, "give hot or placement, not both"),
    ("[[daemon]]\ndevice = 'cpu'\n[[daemon]]\nname = 'x'\n", 4, "[[daemon]] x needs a device, an endpoint or both"),
    ("[[daemon]]\ndevice = 'cpu'\nlisten = 'ipc:///tmp/a.sock'\n", 4,
     "[[daemon]] d0: listen needs a device and an endpoint"),
    ("[[daemon]]\nname = 'a'\ndevice = 'cpu'\n[[daemon]]\nname = 'a'\ndevice = 'cpu'\n", 6,
     "two [[daemon]] tables are named 'a'"),
    ("[[daemon]]\nendpoint = 'tcp://h:1'\ncurve_secret_key = 'k'\n", 2,
     "[[daemon]] d0: curve_secret_key and curve_authorized_keys go together"),
    ("[[daemon]]\nendpoint = 'tcp://h:1'\ncurve_public_key = 'k'\n", 4,
     "[[daemon]] d0: curve_public_key needs [auth] client_secret_key"),
]


@pytest.mark.parametrize("text,line,message", RULES)
def test_keys_that_do_not_go_together(moerun, tmp_path, text, line, message):
    path = write(tmp_path, "# a rig\n" + text)
    result = moerun("logits", "--ids", "1", "-o", tmp_path / "out.npy", "--config", path)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {path}, line {line}: {message}"


MANY_PROBLEMS = """\
# a rig
ctx = 0
hot = 2
transprt = "shared"
placement = "auto"

[generate]
temp = -1
top_p = 2
seed = 3

[server]
prot = 80
max_body = "lots"

[[daemon]]
device = "gpu"
listen = "ipc:///tmp/a.sock"

[[daemon]]
name = "far"
endpoint = "tcp://h:1"
curve_public_key = "far.key"
curve_secret_key = "far.key_secret"

[[daemon]]
name = "far"
devcie = "cpu"
"""


def test_every_problem_of_a_file_is_reported_at_once_in_file_order(moerun, tmp_path):
    path = write(tmp_path, MANY_PROBLEMS)
    result = moerun("run", "--config", path)
    assert result.exit_code == 1
    assert result.stderr.count("Error:") == 1
    assert result.stderr.strip().splitlines() == [f"Error: {path}, line 2: ctx = 0: must be >= 1", *(
        f"{path}, line {line}: {message}" for line, message in [
            (4, "unknown key 'transprt' (did you mean 'transport'?)"),
            (5, "give hot or placement, not both"),
            (8, "temp = -1: must be >= 0"),
            (9, "top_p = 2: must be > 0 and <= 1"),
            (13, "unknown key 'prot' in [server] (did you mean 'port'?)"),
            (14, "max_body = 'lots': must be a size such as 24GiB, 512MiB or 64GB"),
            (17, "device = 'gpu': must be cpu, cuda:N or hip:N"),
            (18, "[[daemon]] d0: listen needs a device and an endpoint"),
            (20, "[[daemon]] far: curve_secret_key and curve_authorized_keys go together"),
            (23, "[[daemon]] far: curve_public_key needs [auth] client_secret_key"),
            (27, "two [[daemon]] tables are named 'far'"),
            (28, "unknown key 'devcie' in [[daemon]] (did you mean 'device'?)"),
        ])]


@pytest.mark.parametrize("text,line,message", [
    # the daemon's device is reported; that it then has neither device nor endpoint is not
    ("[[daemon]]\ndevice = 'gpu'\n", 3, "device = 'gpu': must be cpu, cuda:N or hip:N"),
    # a misspelt key counts as the key it probably means
    ("[[daemon]]\nendpont = 'tcp://h:1'\nlisten = 'tcp://0.0.0.0:1'\ndevice = 'cpu'\n", 3,
     "unknown key 'endpont' in [[daemon]] (did you mean 'endpoint'?)"),
    ("[auth]\nclient_secret = 'k'\n[[daemon]]\nendpoint = 'tcp://h:1'\ncurve_public_key = 'k'\n", 3,
     "unknown key 'client_secret' in [auth] (did you mean 'client_secret_key'?)"),
    ("hot = -1\nplacement = 'auto'\n", 2, "hot = -1: must be >= 0"),
])
def test_a_key_already_reported_breaks_no_rule_besides(moerun, tmp_path, text, line, message):
    path = write(tmp_path, "# a rig\n" + text)
    result = moerun("run", "--config", path)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {path}, line {line}: {message}"


def test_invalid_toml_names_the_file_and_where(moerun, tmp_path):
    path = write(tmp_path, "ctx = 64\nmode = \n")
    result = moerun("run", "--config", path)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {path}: not valid TOML: ")
    assert "line 2" in result.stderr


def test_key_lines_follow_tables_arrays_and_dotted_keys():
    text = ('ctx = 1  # c\n"mode" = "auto"\nserver.port = 2\n[generate]\nprompt = """\nctx = 9\n"""\n'
            'seed = 3\n[[daemon]]\ndevice = "cpu"\n[[daemon]]\n  device = "cpu"\n')
    lines = key_lines(text)
    assert lines[("ctx",)] == 1 and lines[("mode",)] == 2 and lines[("server", "port")] == 3
    assert lines[("generate",)] == 4 and lines[("generate", "prompt")] == 5 and lines[("generate", "seed")] == 8
    assert ("generate", "ctx") not in lines                 # inside a multi-line string
    assert lines[("daemon", 0, "device")] == 10 and lines[("daemon", 1)] == 11
    assert lines[("daemon", 1, "device")] == 12


# -- values -------------------------------------------------------------------------------------

def test_values_by_parameter_name_with_paths_from_the_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    write(tmp_path, """
model = "models/m.gguf"
placement = "auto"
daemon_timeout = 5
[generate]
stats_json = "~/stats.json"
[auth]
client_secret_key = "keys/parent.key_secret"
[[daemon]]
device = "cuda:1"
memory = "16GiB"
[[daemon]]
name = "far"
endpoint = "tcp://box:7070"
host = "box"
transport = "stream"
curve_public_key = "keys/box.key"
""", name="sub/rig.toml")
    values = load_config_file("sub/rig.toml")
    assert values["model"] == str(tmp_path / "sub" / "models" / "m.gguf")
    assert values["placement"] == "auto" and values["daemon_timeout"] == 5.0
    assert values["stats_json"] == str(Path.home() / "stats.json")
    assert values["client_secret_key"] == str(tmp_path / "sub" / "keys" / "parent.key_secret")
    assert values["daemons"] == ("cuda:1", "tcp://box:7070")
    assert values["daemon_entries"] == (
        DaemonEntry(name="d0", device="cuda:1", memory="16GiB"),
        DaemonEntry(name="far", endpoint="tcp://box:7070", host="box", transport="stream",
                    curve_public_key=str(tmp_path / "sub" / "keys" / "box.key")))


def test_rig_config_checks_the_parent_device_and_the_entries():
    with pytest.raises(ConfigError, match="--device 'gpu': expected cpu, cuda:N or hip:N"):
        RigConfig(device="gpu")
    with pytest.raises(ConfigError, match="do not match"):
        RigConfig(daemons=("cpu",), daemon_entries=(DaemonEntry(name="d0", device="cuda:0"),))
    assert RigConfig(device="hip:1").device == "hip:1"


def test_the_kv_cache_types_are_f16_on_a_gpu_f32_on_the_cpu_each_side_overridable_and_checked():
    assert RigConfig(device="cuda:0").kv_cache_types == KVTypes("f16", "f16")
    assert RigConfig(device="cuda:0", kv_dtype="f32").kv_cache_types == KVTypes("f32", "f32")
    assert RigConfig().kv_cache_types == RigConfig(kv_dtype="f32").kv_cache_types == KVTypes("f32", "f32")
    assert RigConfig(kv_dtype="f16", cache_type_k="q8_0").kv_cache_types == KVTypes("q8_0", "f16")
    assert RigConfig(cache_type_v="q4_0").kv_cache_types == KVTypes("f32", "q4_0")
    assert KVTypes("q8_0", "f16").label == "q8_0/f16" and KVTypes("q4_0", "q4_0").label == "q4_0"
    for field, flag in (("kv_dtype", "--kv-dtype"), ("cache_type_k", "--cache-type-k"),
                        ("cache_type_v", "--cache-type-v")):
        with pytest.raises(ConfigError, match=f"{flag} must be one of f32, f16, bf16, q8_0"):
            RigConfig(device="cuda:0", **{field: "q2_k"})


# -- flags override the file --------------------------------------------------------------------

RIG = """
model = "m.gguf"
device = "cuda:0"
graphs = false
kv_dtype = "f32"
ctx = 100
transport = "stream"
placement = "auto"
require_daemons = true
[[daemon]]
name = "a"
device = "cpu"
[[daemon]]
name = "b"
endpoint = "ipc:///tmp/b.sock"
"""


def test_the_file_fills_the_flags_not_given(tmp_path):
    path = write(tmp_path, RIG)
    flags = shown("--config", path)
    assert flags["model"] == str(tmp_path / "m.gguf") and flags["device"] == "cuda:0" and flags["graphs"] is False
    assert flags["kv_dtype"] == "f32" and flags["ctx"] == 100
    assert flags["transport"] == "stream" and flags["placement"] == "auto"
    assert flags["require_daemons"] is True and flags["ubatch"] == 512    # not in the file: the default
    assert flags["daemons"] == ["cpu", "ipc:///tmp/b.sock"] and flags["entries"] == ["a", "b"]


def test_flags_given_override_the_file_even_when_they_spell_the_default(tmp_path):
    path = write(tmp_path, RIG)
    flags = shown("--config", path, "-m", "other.gguf", "--ctx", "50", "--transport", "auto", "--device", "cpu",
                  "--graph")
    assert flags["model"] == "other.gguf" and flags["ctx"] == 50 and flags["graphs"] is True
    assert flags["transport"] == "auto" and flags["device"] == "cpu"
    assert flags["placement"] == "auto"                                     # not given: from the file


def test_daemon_flags_replace_the_files_daemons(tmp_path):
    flags = shown("--config", write(tmp_path, RIG), "--daemon", "cpu")
    assert flags["daemons"] == ["cpu"] and flags["entries"] == []


def test_hot_on_the_command_line_replaces_the_files_placement(tmp_path):
    flags = shown("--config", write(tmp_path, RIG), "--hot", "3")
    assert flags["hot"] == 3 and flags["placement"] is None
    flags = shown("--config", write(tmp_path, "hot = 2\n"), "--placement", "p.json")
    assert flags["hot"] is None and flags["placement"] == "p.json"


def test_without_a_file_every_flag_keeps_its_default():
    flags = shown()
    assert flags["daemons"] == [] and flags["entries"] == [] and flags["client_secret_key"] is None
    assert flags["device"] == "cpu" and flags["transport"] == "auto"


def test_run_takes_the_generation_from_the_file_and_flags_over_it(moerun, tmp_path):
    model = demo_model_path()
    path = write(tmp_path, f'model = "{model}"\nctx = 128\n[generate]\nprompt = "The rig"\nn_predict = 12\n'
                           f'temp = 0.0\n')
    with Runtime(model, ctx=128) as runtime:
        ids = runtime.tokenizer.encode("The rig")
        tokens = list(runtime.generate(ids, 12, SamplingParams(temperature=0.0), runtime.tokenizer.stop_ids))
        expected = runtime.tokenizer.decode(tokens)
        expected_short = runtime.tokenizer.decode(tokens[:4])
    assert len(tokens) == 12 and expected != expected_short
    assert moerun("run", "--config", path).stdout == expected + "\n"
    assert moerun("run", "--config", path, "-n", "4").stdout == expected_short + "\n"


def test_logits_takes_the_model_from_the_file(moerun, tmp_path):
    path = write(tmp_path, f'model = "{demo_model_path()}"\n')
    result = moerun("logits", "--config", path, "--ids", "1,2,3", "-o", tmp_path / "l.npy")
    assert result.exit_code == 0, result.output
    assert "wrote logits [3, " in result.stderr


def test_logits_without_a_model_anywhere_uses_the_demo_model(moerun, tmp_path):
    """The one rule of every command that takes -m: without one, the built-in demo model (said)."""
    result = moerun("logits", "--config", write(tmp_path, "ctx = 8\n"), "--ids", "1", "-o", tmp_path / "l.npy")
    assert result.exit_code == 0, result.output
    assert "built-in demo model" in result.stderr
    assert np.load(tmp_path / "l.npy").shape[0] == 1


def test_a_bad_device_flag_is_one_error_line(moerun):
    result = moerun("run", "--device", "tpu:0", "-n", "1")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == "Error: --device 'tpu:0': expected cpu, cuda:N or hip:N"


# -- plan --------------------------------------------------------------------------------------

def test_plan_reads_devices_memory_and_context_from_the_file(moerun, tmp_path):
    path = write(tmp_path, f'model = "{demo_model_path()}"\ndevice = "cuda:0"\nmemory = "8MiB"\nctx = 64\n'
                           f'kv_dtype = "f32"\n[[daemon]]\nname = "g"\ndevice = "cuda:1"\nmemory = "1GiB"\n')
    out = tmp_path / "placement.json"
    result = moerun("plan", "--config", path, "--safety", "0", "--workspace", "0", "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["daemons"] == ["cuda:1"]
    assert re.search(r"parent cuda:0\s+8\.0 MiB", result.stdout)
    assert "KV cache: 64 tokens at f32 " in result.stdout


def test_plan_needs_memory_for_every_daemon_of_the_file(moerun, tmp_path):
    path = write(tmp_path, 'model = "m.gguf"\nmemory = "1GiB"\nctx = 64\n[[daemon]]\ndevice = "cpu"\n')
    result = moerun("plan", "--config", path, "-o", tmp_path / "p.json")
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"Error: {path}: moerun plan needs `memory` in every [[daemon]] "
                                     f"(missing in d0), or --daemon SPEC=SIZE flags")


def test_split_tables_are_the_split_flags(tmp_path):
    path = write(tmp_path, '[[split]]\ndevice = "cuda:1"\nlayer = 24\n\n[[split]]\nendpoint = "tcp://box-2:7071"\n'
                           'layer = 36\n')
    values = load_config_file(path)
    assert values["splits"] == ("cuda:1@24", "tcp://box-2:7071@36")
    assert [(entry.name, entry.layer) for entry in values["split_entries"]] == [("s0", 24), ("s1", 36)]
    assert shown("--config", path)["splits"] == ["cuda:1@24", "tcp://box-2:7071@36"]
    assert shown("--config", path)["split_entries"] == ["s0", "s1"]
    flags = shown("--config", path, "--split", "cpu@2")
    assert flags["splits"] == ["cpu@2"] and flags["split_entries"] == []     # the flags replace the tables


@pytest.mark.parametrize("text,message", [
    ('[[split]]\nlayer = 3\n', "needs a device, an endpoint or both"),
    ('[[split]]\ndevice = "cpu"\n', "needs the first layer it runs"),
    ('[[split]]\ndevice = "cpu"\nlisten = "ipc:///tmp/s"\nlayer = 2\n', "listen needs a device and an endpoint"),
    ('[[split]]\ndevice = "cpu"\nlayer = 0\n', "layer = 0"),
    ('split = "cpu@2"\n', r"list of \[\[split\]\] tables"),
])
def test_a_bad_split_table_is_an_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config_file(write(tmp_path, text))


def test_a_split_tables_expert_daemons_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="hot is for a shard with daemons"):
        load_config_file(write(tmp_path, '[[split]]\ndevice = "cpu"\nlayer = 2\nhot = 1\n'))
    with pytest.raises(ConfigError, match="must be a list of daemons"):
        load_config_file(write(tmp_path, '[[split]]\ndevice = "cpu"\nlayer = 2\ndaemons = ["gpu7"]\n'))
    entry, = load_config_file(write(tmp_path, '[[split]]\ndevice = "cpu"\nlayer = 2\ndaemons = ["cpu", "cuda:1"]\n'
                                              'hot = 3\n'))["split_entries"]
    assert entry.expert_flags == ("--daemon", "cpu", "--daemon", "cuda:1", "--hot", "3")


def test_one_table_gives_the_flags_the_keys_and_the_rig_settings():
    """config.RUN_OPTIONS is the one place a model-loading option is written: its flag declares
    the parameter of its name, its key is the config file's, and together the options set every
    RigConfig field the file's tables do not, each field from exactly one option."""
    import dataclasses

    from moerun.config import RUN_OPTIONS, TOP_LEVEL
    from moerun.rig.settings import RigConfig

    for option in RUN_OPTIONS:
        declared = option.flag(lambda **params: None).__click_params__[-1]
        assert declared.name == option.name
        assert (option.key is None) or TOP_LEVEL[option.name] is option.key
    samples = {"daemons": ("cpu",), "splits": ("cpu@2", "auto"), "expert_cache": "1GiB", "daemon_public_keys": ("k",)}
    set_by: dict[str, list[str]] = {}
    for option in RUN_OPTIONS:
        if option.rig is not None:
            for name in option.rig(samples.get(option.name, None)):
                set_by.setdefault(name, []).append(option.name)
    fields = {f.name for f in dataclasses.fields(RigConfig)} - {"daemon_entries", "split_entries"}
    assert set(set_by) == fields
    assert all(len(options) == 1 for options in set_by.values())
