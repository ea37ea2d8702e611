"""`ckptwatch lint` (monitor/lint/, monitor/cli/lint.py).

The corpus under tests/lint_corpus/ is realistic training code in the styles of plain DDP,
Lightning, accelerate, transformers Trainer callbacks and DeepSpeed. Every line that must be
reported carries a trailing `# expect: CODE` comment; the linter's findings must be exactly
those, no extra and none missing.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from collections import Counter

import pytest

from helpers import REPO_ROOT, subprocess_env
from monitor.cli import lint as lint_cli
from monitor.lint import lint_source

CORPUS = os.path.join(REPO_ROOT, "tests", "lint_corpus")
CORPUS_FILES = sorted(f for f in os.listdir(CORPUS) if f.endswith(".py"))
_EXPECT = re.compile(r"#\s*expect:\s*([A-Z0-9,\s]+)")


def expected(path: str) -> Counter:
    """(line, code) for every `# expect: CODE[, CODE]` comment in a corpus file."""
    out = Counter()
    with open(path, encoding="utf-8") as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type == tokenize.COMMENT:
                match = _EXPECT.search(tok.string)
                if match:
                    for code in match.group(1).replace(",", " ").split():
                        out[(tok.start[0], code)] += 1
    return out


def found(path: str) -> Counter:
    return Counter((f.line, f.code) for f in lint_cli.lint_file(path))


def lint(code: str, **kw) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint_source(textwrap.dedent(code), "t.py", **kw)]


def test_corpus_covers_every_style():
    names = " ".join(CORPUS_FILES)
    for style in ("ddp", "lightning", "accelerate", "hf_trainer", "deepspeed", "single_process"):
        assert style in names


@pytest.mark.parametrize("name", CORPUS_FILES)
def test_corpus_findings_are_exactly_the_annotated_ones(name):
    path = os.path.join(CORPUS, name)
    want, got = expected(path), found(path)
    missing = sorted((want - got).elements())
    extra = sorted((got - want).elements())
    assert not missing and not extra, f"{name}: missing {missing}, extra {extra}"


def test_corpus_has_findings_of_every_code():
    codes = set()
    for name in CORPUS_FILES:
        codes |= {code for (_, code) in expected(os.path.join(CORPUS, name))}
    assert {"CKW001", "CKW002", "CKW003"} <= codes


# ---------------------------------------------------------------------------- rules in isolation


DIST = "import torch\nimport torch.distributed as dist\n"


def test_guard_and_is_guarded_or_is_not():
    assert lint(DIST + textwrap.dedent("""
        def f(rank, step, force, m):
            if rank == 0 and step % 10 == 0:
                torch.save(m, "a.pt")
            if step % 10 == 0 and rank == 0:
                torch.save(m, "b.pt")
            if rank == 0 or force:
                torch.save(m, "c.pt")
            if not (rank != 0 or force):
                torch.save(m, "d.pt")
        """)) == [(10, "CKW001")]


def test_single_process_module_is_not_linted_unless_asked():
    code = "import torch\ntorch.save({}, 'x.pt')\n"
    assert lint(code) == []
    assert lint(code, assume_distributed=True) == [(2, "CKW001")]


def test_helper_called_once_unguarded_is_flagged():
    code = DIST + textwrap.dedent("""
        def save(m):
            torch.save(m, "a.pt")

        def train(m):
            if dist.get_rank() == 0:
                save(m)
            save(m)
        """)
    assert lint(code) == [(5, "CKW001")]
    assert lint(code.replace("\n    save(m)\n", "\n    pass\n")) == []


def test_helper_passed_as_a_value_is_not_trusted():
    code = DIST + textwrap.dedent("""
        import atexit

        def save():
            torch.save({}, "a.pt")

        def train():
            if dist.get_rank() == 0:
                save()
            atexit.register(save)
        """)
    assert lint(code) == [(7, "CKW001")]


def test_recursion_does_not_make_a_function_look_guarded():
    code = DIST + textwrap.dedent("""
        def save(n):
            torch.save({}, "a.pt")
            if n:
                save(n - 1)
        """)
    assert lint(code) == [(5, "CKW001")]


def test_stream_and_read_only_files_are_not_writes():
    assert lint(DIST + textwrap.dedent("""
        import io, json, pickle
        buf = io.BytesIO()
        torch.save({}, buf)
        with open("cfg.json") as f:
            json.dump({}, f)
        pickle.dump({}, sock_file)
        """)) == []


def test_open_for_writing_on_every_rank_is_unsafe_even_if_the_dump_is_guarded():
    assert lint(DIST + textwrap.dedent("""
        import json
        with open("m.json", "w") as f:
            if dist.get_rank() == 0:
                json.dump({}, f)
        """)) == [(7, "CKW001")]


def test_suppression_by_code_and_for_all_codes():
    code = DIST + textwrap.dedent("""
        torch.save({}, "a.pt")  # ckptwatch: ignore[CKW001]
        torch.save({}, "b.pt")  # ckptwatch: ignore
        torch.save({}, "c.pt")  # ckptwatch: ignore[CKW002]
        s = "torch.save  # ckptwatch: ignore"; torch.save({}, "d.pt")
        torch.save(
            {}, "e.pt")  # ckptwatch: ignore[CKW001]
        """)
    assert lint(code) == [(6, "CKW001"), (7, "CKW001")]


def test_accelerate_saves_are_main_process_only_unless_saved_on_each_node():
    code = textwrap.dedent("""
        from accelerate import Accelerator
        accelerator = Accelerator()
        accelerator.save({}, "a.pt")
        accelerator.save_model(model, "out")
        """)
    assert lint(code) == []
    each_node = code.replace("Accelerator()", "Accelerator(project_config=ProjectConfiguration("
                             "save_on_each_node=True))")
    findings = lint_source(each_node, "t.py")
    assert [(f.line, f.code) for f in findings] == [(4, "CKW002"), (5, "CKW002")]
    assert "save_on_each_node" in findings[0].message


def test_local_rank_message_names_the_guard_or_the_path():
    findings = lint_source(DIST + textwrap.dedent("""
        if local_rank == 0:
            torch.save({}, "a.pt")
        torch.save({}, f"b{local_rank}.pt")
        tok.save_pretrained("out", is_main_process=accelerator.is_local_main_process)
        """), "t.py")
    assert [f.code for f in findings] == ["CKW002", "CKW002", "CKW002"]
    assert "guarded only by the local rank" in findings[2].message
    assert "guarded only by the local rank" in findings[0].message
    assert "path holds only the local rank" in findings[1].message


def test_syntax_error_is_a_finding():
    findings = lint_source("import torch.distributed\ndef f(:\n", "bad.py")
    assert [(f.line, f.code) for f in findings] == [(2, "CKW999")]
    assert "syntax error" in findings[0].message


def test_deeply_nested_source_is_a_finding_not_a_crash():
    deep = "import torch.distributed\nx = " + "+".join(["rank"] * 20000) + "\n"
    findings = lint_source(deep, "deep.py")
    assert [f.code for f in findings] == ["CKW999"]
    nested_ifs = "import torch.distributed\n" + "".join(
        " " * i + "if rank == 0:\n" for i in range(90)) + " " * 90 + "torch.save(x, 'a')\n"
    assert lint_source(nested_ifs, "ifs.py") == []


# ---------------------------------------------------------------------------- the command


def run_cli(*argv, cwd=CORPUS):
    return subprocess.run([sys.executable, "-m", "monitor.cli", "lint", *argv], cwd=cwd,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


def test_cli_prints_ruff_style_lines_and_exits_1_on_findings():
    proc = run_cli("ddp_plain.py", "single_process.py")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    want = expected(os.path.join(CORPUS, "ddp_plain.py"))
    assert len(lines) == sum(want.values())
    for line in lines:
        m = re.fullmatch(r"ddp_plain\.py:(\d+):(\d+): (CKW00[12]) \S.*", line)
        assert m, line
        assert (int(m.group(1)), m.group(3)) in want
    assert "ddp_plain.py:48:9: CKW001 torch.save runs on every rank" in proc.stdout


def test_cli_exits_0_on_clean_code():
    proc = run_cli("single_process.py")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_cli_json_format():
    proc = run_cli("--format", "json", ".")
    assert proc.returncode == 1, proc.stderr
    records = json.loads(proc.stdout)
    assert records and all(set(r) == {"path", "line", "col", "code", "message"} for r in records)
    got = Counter((os.path.basename(r["path"]), r["line"], r["code"]) for r in records)
    want = Counter()
    for name in CORPUS_FILES:
        for (line, code), n in expected(os.path.join(CORPUS, name)).items():
            want[(name, line, code)] += n
    assert got == want
    assert all(isinstance(r["line"], int) and r["col"] >= 1 for r in records)


def test_cli_json_is_an_empty_list_when_clean():
    proc = run_cli("--format", "json", "single_process.py")
    assert (proc.returncode, json.loads(proc.stdout)) == (0, [])


def test_cli_missing_path_is_a_usage_error_but_the_rest_is_linted():
    proc = run_cli("no_such_dir", "ddp_plain.py")
    assert proc.returncode == 2
    assert "no_such_dir: no such file or directory" in proc.stderr
    assert "ddp_plain.py:48:9: CKW001" in proc.stdout


def test_cli_without_paths_is_a_usage_error():
    assert run_cli().returncode == 2


def test_cli_syntax_error_and_undecodable_file(tmp_path):
    (tmp_path / "bad.py").write_text("import torch.distributed\nif x ==:\n    pass\n")
    (tmp_path / "latin.py").write_bytes(b"x = '\xff\xfe'\n")
    (tmp_path / "ok.py").write_text("import torch\ntorch.save({}, 'a.pt')\n")
    proc = run_cli(str(tmp_path))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(rf"{re.escape(str(tmp_path))}/bad\.py:2:\d+: CKW999 syntax error.*",
                        lines[0])
    assert lines[1].startswith(f"{tmp_path}/latin.py:1:1: CKW999 cannot read")


def test_directories_are_searched_recursively_skipping_hidden_and_caches(tmp_path):
    for rel in ("a/b/train.py", ".venv/lib/x.py", "a/__pycache__/y.py", "a/notes.txt"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("import torch.distributed\nimport torch\ntorch.save({}, 'a.pt')\n")
    files, missing = lint_cli.find_sources([str(tmp_path)])
    assert [os.path.relpath(f, tmp_path) for f in files] == ["a/b/train.py"]
    assert missing == []


def test_main_parser_knows_lint():
    from monitor.cli.main import main
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        code = main(["lint", os.path.join(CORPUS, "single_process.py")])
    finally:
        sys.stdout = sys_stdout
    assert code == 0 and out.getvalue() == ""


# ---- files that are not files, sizes, encodings (issue 17 items 5, 9) ---------------------

def test_a_fifo_named_like_python_is_a_line_not_a_hang(tmp_path):
    # Old code: open() on a *.py FIFO waited for a writer forever.
    from racer import bounded
    (tmp_path / "ok.py").write_text("x = 1\n")
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    try:
        finished, got = bounded(lambda: lint_cli.lint_paths([str(tmp_path)]), timeout=20)
        assert finished, "lint blocked opening a FIFO"
    finally:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    findings, missing = got
    assert [(os.path.basename(f.path), f.code, f.message) for f in findings] == \
        [("pipe.py", "CKW999", "not read: a FIFO, not a regular file")]


_DEV_ZERO_LINT = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))   # the old code read 3.7 GB
from monitor.cli import lint
try:
    findings, _ = lint.lint_paths([sys.argv[1]])
    print(json.dumps([[f.code, f.message] for f in findings]))
except MemoryError:
    print(json.dumps("MemoryError"))
print(json.dumps(next(int(line.split()[1]) for line in open("/proc/self/io")
                      if line.startswith("rchar"))))
"""


def test_a_link_to_dev_zero_is_not_read(tmp_path):
    (tmp_path / "zero.py").symlink_to("/dev/zero")
    proc = subprocess.run([sys.executable, "-c", _DEV_ZERO_LINT, str(tmp_path)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found, bytes_read = map(json.loads, proc.stdout.splitlines()[-2:])
    assert found == [["CKW999", "not read: a character device, not a regular file"]], found
    assert bytes_read < 64 << 20, bytes_read        # its own modules, nothing of /dev/zero


def test_a_file_too_large_to_parse_is_not_checked_and_says_so(tmp_path):
    # Old code: a 200 MB file peaked at 12.2 GB and came out as "too deeply nested". The
    # size is judged before a byte is read: a sparse file is enough here.
    big = tmp_path / "generated.py"
    with open(big, "wb") as f:
        f.write(b"import torch.distributed\n")
        f.truncate(lint_cli.MAX_SOURCE_BYTES + 1)
    (finding,) = lint_cli.lint_file(str(big))
    assert finding.code == "CKW999" and finding.message.startswith("not checked: 2.0MiB")
    assert "larger than the 2.0MiB lint reads" in finding.message
    # --max-file-size (MiB) moves the bound both ways.
    small = tmp_path / "small.py"
    small.write_text("import torch.distributed\n" + "x = 1\n" * 400)
    proc = run_cli("--max-file-size", "0.001", str(small))
    assert proc.returncode == 1 and "CKW999 not checked: 2.4KiB" in proc.stdout
    assert run_cli("--max-file-size", "1", str(small)).returncode == 0
    assert run_cli("--max-file-size", "0", str(small)).returncode == 2


def test_a_memory_error_is_not_called_nesting():
    import ast

    def no_memory(*args, **kwargs):
        raise MemoryError

    import monitor.lint.checker as checker
    real = checker.ast.parse
    checker.ast.parse = no_memory
    try:
        (finding,) = lint_source("x = 1\n", "m.py")
    finally:
        checker.ast.parse = real
    assert finding.code == "CKW999" and "nested" not in finding.message
    assert "too large" in finding.message
    assert ast.parse is real


@pytest.mark.parametrize("coding, text", [
    ("latin-1", "café"), ("cp1252", "naïve – ok"), ("utf-8", "日本"), ("koi8-r", "привет")])
def test_a_declared_source_encoding_is_honoured(tmp_path, coding, text):
    # Old code: every non-UTF-8 file was CKW999 "cannot read" (exit 1), whatever it declared.
    path = tmp_path / "train.py"
    path.write_bytes((f"# -*- coding: {coding} -*-\nimport torch.distributed\nimport torch\n"
                      f"name = '{text}.pt'\ntorch.save({{}}, name)\n").encode(coding))
    findings = lint_cli.lint_file(str(path))
    assert [(f.line, f.code) for f in findings] == [(5, "CKW001")], findings


def test_an_unknown_declared_encoding_is_a_clear_line(tmp_path):
    path = tmp_path / "odd.py"
    path.write_bytes(b"# coding: no-such-codec\nx = 1\n")
    (finding,) = lint_cli.lint_file(str(path))
    assert finding.code == "CKW999" and "no-such-codec" in finding.message


def test_text_output_escapes_control_characters_in_paths(tmp_path):
    (tmp_path / "a\x1b]0;pwned\x07.py").write_text("x = (\n")
    proc = run_cli(str(tmp_path))
    assert proc.returncode == 1
    assert "\x1b" not in proc.stdout and "\\x1b]0;pwned\\x07.py" in proc.stdout
