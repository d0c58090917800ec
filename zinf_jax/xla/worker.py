"""The process that compiles programs for one accelerator without one: ``python -m zinf_jax.xla.worker DIR``.

:mod:`zinf_jax.xla.deviceless` starts it: XLA's TPU compiler can run without end on a program it does not
handle, or abort the process (a failed ``CHECK``), and both XLA compilers write their warnings to the
process's standard error, so each compile runs here, its standard error sent to a file of its own.

``DIR/request.json`` names the target and the jobs; each job's program is ``DIR/<id>.program`` (bytecode,
from :func:`zinf_jax._internal.jax_private.lowered_program`) with ``DIR/<id>.json`` (its settings).
For each job in order this writes ``DIR/<id>.log`` (XLA's standard error), ``DIR/<id>.hlo`` (the compiled
program's text) and last ``DIR/<id>.done`` (a JSON result): a job without ``.done`` did not finish.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _devices(request: dict, count: int) -> list:
    from jax.experimental import topologies

    from zinf_jax.xla.targets import gpu_description, target

    t = target(request["target"])
    if t.platform == "cuda":
        return list(topologies.get_topology_desc(platform="cuda", target_config=gpu_description(t),
                                                 topology=f"1x1x{count}").devices)
    shape = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}.get(count)
    if shape is None:
        raise ValueError(f"no {t.name} topology of {count} chips here (1, 2, 4 or 8)")
    bounds = (min(shape[0], 2), min(shape[1], 2), 1)
    return list(topologies.get_topology_desc(platform="tpu", topology_name=f"{t.tpu_topology}:{shape[0]}x{shape[1]}",
                                             chip_config_name="default", chips_per_host_bounds=bounds,
                                             num_slices=1).devices)


def main(folder: str) -> int:
    from zinf_jax._internal.jax_private import compile_deviceless

    with open(os.path.join(folder, "request.json")) as f:
        request = json.load(f)
    err = os.dup(2)
    for job in request["jobs"]:
        base = os.path.join(folder, job)
        if os.path.exists(base + ".done"):
            continue
        with open(base + ".json") as f:
            meta = json.load(f)
        with open(base + ".program", "rb") as f:
            program = {**meta, "bytecode": f.read()}
        log = os.open(base + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 2)
        t0 = time.perf_counter()
        result: dict = {"ok": False}
        try:
            compiled = compile_deviceless(program, _devices(request, program["devices"]), meta.get("options", {}))
            with open(base + ".hlo", "w") as f:
                f.write("\n\n".join(m.to_string() for m in compiled.hlo_modules()))
            result = {"ok": True, "memory": _memory(compiled)}
        except Exception as e:  # the compiler refused the program: that is the result
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = time.perf_counter() - t0
        sys.stderr.flush()
        os.dup2(err, 2)
        os.close(log)
        with open(base + ".done.tmp", "w") as f:
            json.dump(result, f)
        os.replace(base + ".done.tmp", base + ".done")
    return 0


def _memory(compiled) -> dict | None:
    try:
        stats = compiled.get_compiled_memory_stats()
    except Exception:  # a client without it
        return None
    return {k: int(getattr(stats, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "temp_size_in_bytes", "alias_size_in_bytes",
                                                 "host_argument_size_in_bytes", "host_output_size_in_bytes",
                                                 "host_temp_size_in_bytes") if hasattr(stats, k)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
