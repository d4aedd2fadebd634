"""The command line, as scripts use it: `convo chat --script --json` and `convo plan --json`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import check_plan_json

REQUIRED = {
    "turn": int,
    "reply": str,
    "prompt_tokens": int,
    "parts": dict,
    "budget": int,
    "max_new_tokens": int,
    "summary_tokens": int,
    "summary_tokens_used": int,
    "summary_tokens_cap": int,
    "evicted_turns": int,
    "latency_s": float,
}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convo.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_chat_script_json_lines_and_resume(tmp_path: Path) -> None:
    script = tmp_path / "turns.txt"
    script.write_text("Hi, I am Priya.\n\nI like green tea.\nWhat is 2 + 2?\n", encoding="utf-8")
    db = tmp_path / "chat.db"
    common = ["chat", "--script", str(script), "--json", "--db", str(db), "--session", "s1"]
    first = run_cli(
        *common, "--budget", "512", "--max-new-tokens", "12", "--window", "1", "--summary-tokens", "32"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert [r["turn"] for r in rows] == [1, 2, 3]  # the blank line is skipped
    for row in rows:
        for key, typ in REQUIRED.items():
            assert isinstance(row[key], typ), (key, row[key])
        assert row["prompt_tokens"] + row["max_new_tokens"] <= row["budget"] == 512
        assert row["prompt_tokens"] == sum(v for k, v in row["parts"].items() if k != "reserve")
        assert row["summary_tokens_used"] == row["parts"].get("summary", 0) <= row["summary_tokens_cap"] == 32
        assert row["reply"].strip()
    assert "loading model" in first.stderr  # the progress indicator
    # Resumed in a new process: numbering and settings continue.
    second = run_cli(*common)
    assert second.returncode == 0, second.stderr[-2000:]
    rows2 = [json.loads(line) for line in second.stdout.splitlines()]
    assert [r["turn"] for r in rows2] == [4, 5, 6]
    assert all(r["budget"] == 512 and r["max_new_tokens"] == 12 for r in rows2)
    assert rows2[-1]["evicted_turns"] >= 3


@pytest.mark.slow
def test_chat_memory_brings_back_a_turn_that_left_the_window(tmp_path: Path) -> None:
    """``convo chat --memory``: a fact from a turn that left the one-turn window (turns leave
    it four at a time) comes back as retrieved memory when a later question asks for it."""
    script = tmp_path / "turns.txt"
    lines = ["My locker code is 4711.", "Nice weather.", "Soup for lunch.", "I like tea.", "It rained."]
    lines += ["Busy day.", "What is my locker code?"]
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    done = run_cli(
        "chat", "--script", str(script), "--json", "--db", str(tmp_path / "m.db"), "--memory",
        "--budget", "1024", "--max-new-tokens", "8", "--window", "1", "--summary-tokens", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["turn"] for r in rows] == list(range(1, 8))
    assert rows[0]["parts"]["retrieved"] == 0 and rows[-1]["parts"]["retrieved"] > 0
    assert all(r["prompt_tokens"] + r["max_new_tokens"] <= r["budget"] for r in rows)


def test_plan_json_contract() -> None:
    out = run_cli(
        "plan",
        "--model",
        "random:llama-2-7b",
        "--context",
        "1024,4096",
        "--concurrency",
        "1,4",
        "--gpu-memory",
        "24GiB",
        "--quant",
        "nf4",
        "--kv-slots",
        "0",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    check_plan_json(data, cells=4, gpu_memory_bytes=24 * 2**30)
    small = next(c for c in data["cells"] if c["context"] == 1024 and c["concurrency"] == 1)
    big = next(c for c in data["cells"] if c["context"] == 4096 and c["concurrency"] == 4)
    assert small["safe"] and big["kv_bytes"] == 16 * small["kv_bytes"]


def test_plan_refuses_memory_without_a_unit_and_plans_int4_slots() -> None:
    bare = run_cli("plan", "--gpu-memory", "24")
    assert bare.returncode == 2 and not bare.stdout
    assert "--gpu-memory" in bare.stderr and "24GiB" in bare.stderr and "Traceback" not in bare.stderr
    out = run_cli(
        "plan", "--model", "random:llama-2-7b", "--quant", "int4", "--kv-slots", "4",
        "--context", "4096", "--concurrency", "1,8", "--gpu-memory", "24GiB", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["quant"] == "int4" and data["kv_slots"] == 4 and data["memory_source"] == "--gpu-memory"
    one, eight = data["cells"]
    assert one["kv_bytes"] == eight["kv_bytes"] == 4 * 4096 * 524_288  # the pool
    assert (eight["running"], eight["queued"]) == (4, 4)
    assert one["headroom_bytes"] == 24 * 2**30 - one["peak_reserved_bytes"] > 0


def test_bad_arguments_fail_cleanly(tmp_path: Path) -> None:
    out = run_cli(
        "chat",
        "--script",
        str(tmp_path / "missing.txt"),
        "--budget",
        "100",
        "--max-new-tokens",
        "200",
        "--db",
        str(tmp_path / "x.db"),
    )
    assert out.returncode == 2
    assert "convo: error:" in out.stderr and "Traceback" not in out.stderr
    missing = run_cli("chat", "--script", str(tmp_path / "missing.txt"), "--db", str(tmp_path / "x.db"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


# -- the CLI tells the truth --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5"])
def test_budget_flag_gives_one_message_for_zero_and_negatives(value: str) -> None:
    out = run_cli("chat", "--budget", value, "--script", "/dev/null")
    assert out.returncode == 2
    assert f"--budget: must be a whole number >= 1, got {value}" in out.stderr


def test_a_missing_model_path_fails_before_loading_and_never_says_ready(tmp_path: Path) -> None:
    script = tmp_path / "t.txt"
    script.write_text("hi\n")
    out = run_cli("chat", "--model", "/nope/model", "--script", str(script), "--db", str(tmp_path / "x.db"))
    assert out.returncode == 2
    assert "no model at /nope/model" in out.stderr
    assert "ready" not in out.stderr and "loading model" not in out.stderr


def test_spinner_reports_failure_not_ready() -> None:
    import io

    from convo.cli.common import spinner

    stream = io.StringIO()
    with pytest.raises(RuntimeError), spinner("loading model", stream) as update:
        update("step 1")
        raise RuntimeError("boom")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[convo] loading model" and lines[1] == "[convo] step 1"
    assert lines[-1].startswith("[convo] failed after") and "ready" not in stream.getvalue()


def _session(tmp_path: Path, engine: object | None = None) -> object:
    import convo
    from convo.testing import ScriptedEngine

    return convo.Session(
        engine or ScriptedEngine(),
        budget=convo.Budget(context_tokens=400, max_new_tokens=20),
        store=convo.SQLiteStore(tmp_path / "s.db"),
    )


def _args(**kw: object) -> object:
    import argparse

    return argparse.Namespace(**{"timeout": None, "json": False, **kw})


def test_interactive_commands_are_not_sent_or_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from convo.cli.chat import _handle

    session = _session(tmp_path)
    args = _args()
    last = _handle(session, "hello", "hello", args, None)
    assert last is not None and last.text == "reply 1"
    for line in ["/help", "/history", "/summary", "/stats", "/nope"]:
        assert _handle(session, line, line, args, last) is last
    out = capsys.readouterr()
    assert "/pin TEXT" in out.out and "user: hello" in out.out and "assistant: reply 1" in out.out
    assert "unknown command '/nope'" in out.err
    _handle(session, "/pin I am vegetarian", "/pin I am vegetarian", args, last)
    assert "pinned (1 pinned message(s))" in capsys.readouterr().out
    assert [m.content for m in session.messages] == ["I am vegetarian", "hello", "reply 1"]
    _handle(session, "//etc is a folder", "//etc is a folder", args, last)
    assert session.messages[-2].content == "/etc is a folder"  # '//' escapes a leading '/'


def test_a_scripted_reply_cut_by_the_timeout_says_so_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses

    from convo.cli.chat import EXIT_TIMEOUT, _script
    from convo.models import FinishReason
    from convo.testing import ScriptedEngine

    class SlowEngine(ScriptedEngine):
        def generate(self, messages: object, **kw: object) -> object:  # type: ignore[override]
            gen = super().generate(messages, **kw)  # type: ignore[arg-type]
            return dataclasses.replace(gen, finish_reason=FinishReason.TIMEOUT)

    script = tmp_path / "t.txt"
    script.write_text("one\ntwo\n")
    status = _script(_session(tmp_path, SlowEngine()), _args(script=str(script), timeout=2.0))
    assert status == EXIT_TIMEOUT
    assert "turn 1: reply cut: it hit the --timeout of 2 s" in capsys.readouterr().err


def test_serve_says_where_it_listens(tmp_path: Path) -> None:
    import os
    import time

    env = {**os.environ, "CONVO_FAKE_ENGINE": "1"}
    cmd = [sys.executable, "-m", "convo.cli", "serve", "--port", "0", "--db", str(tmp_path / "s.db")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, line = time.monotonic() + 60, ""
        assert proc.stderr is not None
        while time.monotonic() < deadline and "listening on" not in line:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
        assert "[convo] listening on http://127.0.0.1:" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert port > 0  # the real port, even when asked for port 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_too_long_system_prompt_is_a_flag_error(tmp_path: Path) -> None:
    script = tmp_path / "t.txt"
    script.write_text("hi\n")
    out = run_cli(
        "chat", "--system", "be brief " * 400, "--budget", "512", "--script", str(script),
        "--db", str(tmp_path / "x.db"),
    )  # fmt: skip
    assert out.returncode == 2
    assert "--system is" in out.stderr and "raise --budget" in out.stderr
    assert "pinned_tokens" not in out.stderr


def test_quant_choices_come_from_the_quant_enum() -> None:
    from convo.cli import build_parser
    from convo.models import Quant

    parser = build_parser()
    for command in ("chat", "serve"):
        assert parser.parse_args([command]).quant == Quant.AUTO
        for q in Quant:
            if q in (Quant.FP4, Quant.NONE):  # fp4: convo plan only; none: the planner's spelling
                with pytest.raises(SystemExit):
                    parser.parse_args([command, "--quant", q.value])
            else:
                assert Quant.parse(parser.parse_args([command, "--quant", q.value]).quant) is q
    plan = parser.parse_args(["plan", "--quant", Quant.FP4.value])
    assert plan.quant == "fp4"


def test_int4_kernel_flag_is_one_choice_for_serve_chat_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """``--int4-kernel`` takes the engine's choices in every command, and ``convo plan``
    prices what it keeps: both int4 layouts by default, one with ``triton``."""
    from convo.cli import build_parser, main
    from convo.models import INT4_KERNELS

    parser = build_parser()
    for command in ("chat", "serve", "plan"):
        assert parser.parse_args([command]).int4_kernel == "auto"
        for kernel in INT4_KERNELS:
            assert parser.parse_args([command, "--int4-kernel", kernel]).int4_kernel == kernel
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--int4-kernel", "cutlass"])
    weights = {}
    for kernel in ("auto", "triton"):
        args = ["--model", "random:llama-2-7b", "--quant", "int4", "--gpu-memory", "80GiB", "--json"]
        assert main(["plan", *args, "--int4-kernel", kernel]) == 0
        weights[kernel] = json.loads(capsys.readouterr().out)["weights_bytes"]
    assert 1.8 < weights["auto"] / weights["triton"] < 2.0  # the int4 layers twice, the rest once


def test_version_and_a_subcommands_own_usage_for_an_unknown_flag() -> None:
    from convo import __version__

    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"convo {__version__}"
    bogus = run_cli("chat", "--bogus")
    assert bogus.returncode == 2
    assert bogus.stderr.startswith("usage: convo chat ")  # chat's usage, not the top level's
    assert "convo chat: error: unrecognized arguments: --bogus" in bogus.stderr


def _unreachable_engine() -> list[str]:
    """Flags for a remote engine nobody listens on: the CLI fails before it is ever called."""
    return ["--engine-url", "http://127.0.0.1:9/v1", "--engine-context", "2048"]


def test_unusable_script_and_db_files_are_flag_errors_not_tracebacks(tmp_path: Path) -> None:
    bad_utf8 = tmp_path / "latin1.txt"
    bad_utf8.write_bytes("café\n".encode("latin-1"))
    turns = tmp_path / "turns.txt"
    turns.write_text("hi\n", encoding="utf-8")
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a database\n")
    cases = {
        "--script": ["--script", str(bad_utf8), "--db", str(tmp_path / "ok.db")],
        "--db": ["--script", str(turns), "--db", str(text_file)],
        "--db ": ["--script", str(turns), "--db", str(tmp_path)],  # a folder
        "--script ": ["--script", str(tmp_path), "--db", str(tmp_path / "ok.db")],  # a folder
    }
    for flag, argv in cases.items():
        out = run_cli("chat", *argv, *_unreachable_engine())
        assert out.returncode == 2, (flag, out.stderr[-1500:])
        assert "Traceback" not in out.stderr, out.stderr[-1500:]
        assert out.stderr.startswith(f"convo: error: {flag.strip()} "), out.stderr
    assert text_file.read_text() == "not a database\n"  # left as it was


# -- flags checked against the model's context before it loads (issue 27 #20) -------------


def _config_only_model(tmp_path: Path, context: int, *, files: tuple[str, ...] = ()) -> Path:
    """A model folder with a config (``context`` tokens) and empty ``files``: enough for
    every check made before loading, nothing to load."""
    folder = tmp_path / "small-context-model"
    folder.mkdir()
    config = {"model_type": "llama", "max_position_embeddings": context}
    (folder / "config.json").write_text(json.dumps(config))
    for name in files:
        (folder / name).write_bytes(b"")
    return folder


def test_a_budget_over_the_models_context_is_refused_before_loading_naming_the_flag(tmp_path: Path) -> None:
    script = tmp_path / "t.txt"
    script.write_text("hi\n")
    common = ["chat", "--script", str(script), "--db", str(tmp_path / "x.db")]
    big = run_cli(*common, "--budget", "100000")  # the embedded model: 8192 tokens
    assert big.returncode == 2, big.stderr[-1500:]
    assert "--budget 100000 is over the 8192-token context" in big.stderr
    assert "Budget.context_tokens" not in big.stderr and "loading model" not in big.stderr
    small = _config_only_model(tmp_path, 1024, files=("model.safetensors", "tokenizer.json"))
    default = run_cli(*common, "--model", str(small))  # the default --budget, 2048
    assert default.returncode == 2
    assert f"--budget (default) 2048 is over the 1024-token context of {small}" in default.stderr
    assert "pass --budget 1024 or less" in default.stderr and "loading model" not in default.stderr


def test_model_context_tokens_reads_configs_and_gguf_headers(tmp_path: Path) -> None:
    import struct

    from convo.cli.common import check_context_flags, model_context_tokens

    assert model_context_tokens(_config_only_model(tmp_path, 1024)) == 1024
    assert model_context_tokens("random:llama-2-7b") == 4096
    assert model_context_tokens(tmp_path / "nothing-here") is None

    def gguf_string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 3)
    header += gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("qwen2")
    header += gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2)
    header += gguf_string("a") + gguf_string("b")  # an array, skipped
    header += gguf_string("qwen2.context_length") + struct.pack("<II", 4, 32768)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(header)
    assert model_context_tokens(gguf) == 32768
    assert check_context_flags(gguf, {"--budget": 32768, "--max-new-tokens": None}) == 32768
    with pytest.raises(Exception, match=r"--budget 40000 is over the 32768-token context"):
        check_context_flags(gguf, {"--budget": 40000})


# -- a reply that waits for the summary says so (issue 27 #23) -----------------------------


class _WaitingSession:
    """What waiting_notice reads of a session whose summary of turns 1-4 is being written."""

    def __init__(self, status: str, limit: float | None) -> None:
        from convo.summarize import SummaryState, SummaryStatus

        self.summary_state = SummaryState(
            status=SummaryStatus(status), summarized_turns=0, evicted_turns=4, job_turns=(0, 4)
        )
        self.summary_wait_limit = limit


def test_a_reply_that_waits_for_the_summary_says_so_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import time

    from convo.cli import chat

    monkeypatch.setattr(chat, "WAIT_NOTICE_AFTER_S", 0.05)
    monkeypatch.setattr(chat, "WAIT_NOTICE_EVERY_S", 0.1)
    err = io.StringIO()
    with chat.waiting_notice(_WaitingSession("running", 30.0), err):
        time.sleep(0.4)  # the reply has not begun
    lines = err.getvalue().splitlines()
    assert lines[0] == (
        "[convo] waiting for the summary of turns 1-4 (at most 30 s, then the reply goes on without it)"
    )
    assert lines[1].startswith("[convo] still waiting (")
    quiet = io.StringIO()
    with chat.waiting_notice(_WaitingSession("running", 30.0), quiet) as begun:
        begun()  # the reply began at once
        time.sleep(0.2)
    with chat.waiting_notice(_WaitingSession("done", 30.0), quiet):
        time.sleep(0.2)  # no summary being written: nothing to say
    assert quiet.getvalue() == ""


def test_summary_wait_flag_bounds_the_sessions_wait(tmp_path: Path) -> None:
    from convo.cli import build_parser
    from convo.cli.chat import _build_session

    argv = ["chat", "--db", str(tmp_path / "w.db"), "--summary-wait", "5", *_unreachable_engine()]
    session = _build_session(build_parser().parse_args(argv))
    try:
        assert session.summary_wait_limit == 5.0
    finally:
        session.close()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--summary-wait", "-1"])


# -- a model argument fails fast and says what is wrong (issue 27 #26) ---------------------


def test_model_problems_are_named_before_anything_loads(tmp_path: Path) -> None:
    import os
    import time

    script = tmp_path / "t.txt"
    script.write_text("hi\n")
    common = ["chat", "--script", str(script), "--db", str(tmp_path / "x.db")]
    folder = run_cli(*common, "--model", str(_config_only_model(tmp_path, 2048)))
    assert folder.returncode == 2
    assert "has no weights (*.safetensors" in folder.stderr and "and no tokenizer" in folder.stderr
    assert "sentencepiece" not in folder.stderr.lower() and "Traceback" not in folder.stderr
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    hub = subprocess.run(
        [sys.executable, "-m", "convo.cli", *common, "--model", "someorg/not-cached-model"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert time.monotonic() - started < 20  # not transformers' retries
    assert hub.returncode == 2
    assert "--model someorg/not-cached-model: not in the local Hugging Face cache" in hub.stderr
    assert "HF_HUB_OFFLINE is set" in hub.stderr and "loading model" not in hub.stderr


def test_device_cuda_without_a_gpu_is_one_clear_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    script = tmp_path / "t.txt"
    script.write_text("hi\n")
    out = run_cli("chat", "--device", "cuda", "--script", str(script), "--db", str(tmp_path / "x.db"))
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1, lines  # no warnings of other libraries before it
    assert lines[0].startswith(f"convo: error: --device cuda: torch {torch.__version__} (")
    assert lines[0].endswith("sees no CUDA GPU; leave --device out or pass --device cpu")


def test_progress_bars_are_off_when_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import os

    from convo.cli.common import PROGRESS_BAR_ENV, progress_bars_only_on_a_terminal

    for name in PROGRESS_BAR_ENV:
        monkeypatch.delenv(name, raising=False)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_bars_only_on_a_terminal(Terminal()) is True
    assert all(name not in os.environ for name in PROGRESS_BAR_ENV)
    pytest.importorskip("tqdm")
    code = (  # as convo chat does: before transformers (and tqdm) load
        "import io, sys\nfrom convo.cli.common import progress_bars_only_on_a_terminal\n"
        "progress_bars_only_on_a_terminal(io.StringIO())\n"
        "import tqdm\nlog = io.StringIO()\nfor _ in tqdm.tqdm(range(3), file=log):\n    pass\n"
        "print(repr(log.getvalue()))"
    )
    env = {k: v for k, v in os.environ.items() if k not in PROGRESS_BAR_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "''"


def test_chat_runs_without_the_retrieval_extra_and_memory_names_it(tmp_path: Path) -> None:
    """``convo chat`` imports its modules at the top; the retrieval stack (numpy) stays
    optional: only ``--memory`` needs it, and says which extra."""
    script = tmp_path / "t.txt"
    script.write_text("hi\n")
    argv = ["chat", "--memory", "--script", str(script), "--db", str(tmp_path / "x.db")]
    argv += _unreachable_engine()
    code = f"import sys\nsys.modules['numpy'] = None\nfrom convo.cli import main\nsys.exit(main({argv!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-1500:]
    needs = "convo: error: --memory needs the retrieval extra; run: pip install 'convo[retrieval]'"
    assert needs in out.stderr


def test_serve_checks_its_budget_and_port_before_loading(tmp_path: Path) -> None:
    """`convo serve --budget 50000` on the 8,192-token default model started and then refused
    every request; a busy port was found only after loading. Both now exit 2 at once."""
    db = ["--db", str(tmp_path / "s.db")]
    big = run_cli("serve", "--port", "0", "--budget", "50000", *db)
    assert big.returncode == 2, big.stderr[-1500:]
    assert "--budget 50000 is over the 8192-token context" in big.stderr and "loading model" not in big.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = run_cli("serve", "--port", str(port), *db)
    assert taken.returncode == 2, taken.stderr[-1500:]
    assert (
        f"--port {port}: cannot listen on 127.0.0.1:{port}" in taken.stderr
        and "loading model" not in taken.stderr
    )


def test_serve_sizes_itself_to_a_memory_limit_and_refuses_before_loading(tmp_path: Path) -> None:
    """`convo serve --gpu-memory` picks the slots that fit; a setting that cannot fit exits 2
    before anything loads, naming the largest that does."""
    db = ["--db", str(tmp_path / "s.db"), "--port", "0"]
    llama = f"random:{Path(__file__).resolve().parents[2] / 'benchmarks' / 'configs' / 'llama-2-7b'}"
    over = run_cli(
        "serve", "--model", llama, "--quant", "int4", "--kv-slots", "30", "--gpu-memory", "16GiB", *db
    )
    assert over.returncode == 2, over.stderr[-1500:]
    assert "--kv-slots 30 of 2048 tokens (int4) needs" in over.stderr
    assert "the largest safe setting is --kv-slots 9" in over.stderr and "loading model" not in over.stderr
    both = run_cli("serve", "--gpu-memory", "16GiB", "--gpu-memory-utilization", "0.9", *db)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        if not torch.cuda.is_available():  # a setting that fits, on a machine with no GPU
            fits = run_cli("serve", "--model", llama, "--quant", "int4", "--gpu-memory", "16GiB", *db)
            assert fits.returncode == 2 and "sizes a CUDA server" in fits.stderr, fits.stderr[-1500:]
