"""Run in MaxText's own venv by benchmarks/maxtext_plan.py: MaxText's train_compile, unchanged, with its
compiled train step written out for jaxscale's readers.

    MAXTEXT_PYTHON benchmarks/_maxtext_compile.py OUT_DIR MAXTEXT_ARG ...

MAXTEXT_ARGs are train_compile's own (`model_name=llama3-8b compile_topology=v5p-256 ...`;
base.yml is MaxText's installed one). OUT_DIR receives `step.hlo` (the compiled module's text)
and `step.json` (memory_analysis, mesh axes and sizes, compile seconds). Imports only MaxText and
the standard library: jaxscale is not importable in MaxText's venv, and need not be.
"""

import json
import os
import sys
import time


def main(out_dir: str, args: list[str]) -> None:
    from maxtext.trainers.pre_train import train_compile  # MaxText's venv only

    captured = {}
    compile_step = train_compile.jit_and_compile

    def capture(func, args_, kwargs, mesh, *rest, **kw):
        start = time.perf_counter()
        compiled = compile_step(func, args_, kwargs, mesh, *rest, **kw)
        captured.update(compiled=compiled, mesh=dict(mesh.shape), seconds=time.perf_counter() - start)
        return compiled

    train_compile.jit_and_compile = capture
    base = os.path.join(os.path.dirname(train_compile.__file__), "..", "..", "configs", "base.yml")
    train_compile.main(["train_compile", os.path.normpath(base), *args])
    write_step(out_dir, captured["compiled"], captured["mesh"], captured["seconds"], args)


def write_step(out_dir, compiled, mesh: dict, seconds: float, args: list[str]) -> None:
    """`compiled`'s module text as OUT_DIR/step.hlo, its memory_analysis, `mesh` (axis -> size, in
    the mesh's order), compile seconds and `args` as OUT_DIR/step.json."""
    memory = compiled.memory_analysis()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "step.hlo"), "w") as file:
        file.write(compiled.as_text())
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes")
    with open(os.path.join(out_dir, "step.json"), "w") as file:
        json.dump({"memory": {f: getattr(memory, f) for f in fields}, "mesh": mesh,
                   "compile_s": round(seconds, 1), "args": args}, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
