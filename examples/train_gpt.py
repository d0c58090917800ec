"""Train the bundled GPT (Flax NNX) with parameters and optimizer state on NVMe.

    python examples/train_gpt.py --steps 100 --nvme /tmp/zinf_nvme

The same as ``zinf-jax train``, written out as a plain JAX script.
"""
import argparse
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # an 8-device CPU mesh when no accelerator is present

from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--nvme", default="runs/example_nvme")
    ap.add_argument("--ckpt", default="runs/example_ckpt")
    a = ap.parse_args()
    os.makedirs(a.nvme, exist_ok=True)
    cfg = GPTConfig(d_model=128, n_layers=4, seq=64)
    config = zinf.ZeroConfig(
        offload_param=zinf.Offload("nvme", path=a.nvme),
        offload_optimizer=zinf.Offload("nvme", path=a.nvme),
        prefetch_depth=2,
    )
    engine = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, mesh=zinf.make_mesh(),
                             optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0), loss_fn=lm_loss)
    print(zinf.format_table(engine.layouts.values()))
    print(engine.streamed.plan or "plan: made at the first step")
    data = corpus()
    for step in range(engine.step, a.steps):
        m = engine.train_step(batch_at(data, step, 16, cfg.seq))
        if step % 10 == 0:
            print(f"step {step:4d}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}  {m['tokens_per_s']:.0f} tok/s")
    print("saved", engine.save(a.ckpt))
    engine.close()


if __name__ == "__main__":
    main()
