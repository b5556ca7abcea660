"""The documents cannot rot: every command in a `bash test` fenced block of README.md,
CONTRIBUTING.md and docs/ runs, on tiny settings (a training run stops after 1 step, without
evaluations, in a temporary workdir; the other CLI tests' settings, so their compiled steps are
in the persistent cache; a layout search compiles one candidate beside pure FSDP), and exits 0.
Commands are `[VAR=value ...] python -m jaxscale.MODULE ARGS`; they run in this process (its 8
fake devices, as a block's XLA_FLAGS asks), like the other CLI tests."""

import re
import shlex

import pytest

from conftest import ROOT, main_cli

BLOCK = re.compile(r"^```bash test\n(.*?)^```", re.M | re.S)
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
TINY = {"jaxscale.train": ["--config.train.steps=1", "--config.train.eval_every=0"],
        "jaxscale.plan": ["--compile=1", "--workers=1"]}  # a search compiles its best candidate and FSDP


def commands(text: str) -> list[str]:
    """The block's commands: backslash-continued lines joined, comments and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    return [line for line in (shlex.join(shlex.split(raw, comments=True)) for raw in joined.splitlines()) if line]


def blocks() -> list:
    return [pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}:{number}")
            for page in PAGES for number, match in enumerate(BLOCK.finditer(page.read_text()))]


def test_the_documents_have_runnable_blocks():
    """The pages that promise commands have some marked (a renamed marker would skip them all)."""
    ids = [p.id for p in blocks()]
    assert len([i for i in ids if i.startswith("README.md")]) >= 4, ids
    assert any(i.startswith("docs/") for i in ids), ids


@pytest.mark.parametrize("block", blocks())
def test_a_documented_command_runs(block, tmp_path):
    for command in commands(block):
        words = shlex.split(command)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        assert words[:2] == ["python", "-m"] and words[2].startswith("jaxscale."), command
        assert env.keys() <= {"XLA_FLAGS"}, command
        assert env.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8").endswith("count=8"), command
        module, args = words[2], [re.sub(r"^--workdir=runs/", f"--workdir={tmp_path}/", a) for a in words[3:]]
        if module == "jaxscale.train" and not any(a.startswith("--workdir=") for a in args):
            args.append(f"--workdir={tmp_path}/run")  # not the checkout's runs/
        done = main_cli(args + TINY.get(module, []), module=module)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
