"""Train a Flax Linen CNN with zinf_jax: params streamed from host RAM, CPU Adam.

    python examples/train_linen.py
"""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zinf_jax as zinf  # noqa: E402


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x)).reshape(x.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


def loss_fn(model, batch):
    x, y = batch
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(model(x)) * jax.nn.one_hot(y, 10), -1))


def main() -> None:
    key = jax.random.key(0)
    x = jax.random.normal(key, (64, 12, 12, 1))
    y = (x.mean(axis=(1, 2, 3)) > 0).astype(jnp.int32) * 3  # a learnable toy labelling
    engine = zinf.initialize(Net(), init_args=(x[:8],), loss_fn=loss_fn, optimizer=zinf.adam(1e-3),
                             config=zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), persistence_threshold=1000))
    print(zinf.format_table(engine.layouts.values()))
    for step in range(30):
        m = engine.train_step((x, y))
        if step % 5 == 0:
            print(f"step {step:3d}  loss {m['loss']:.4f}")
    print({k: v.shape for k, v in jax.tree_util.tree_leaves_with_path(engine.params())[:2]})
    engine.close()


if __name__ == "__main__":
    main()
