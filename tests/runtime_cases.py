"""Plans for the runtime tests, built by hand from planner/plan.py's dataclasses."""

from __future__ import annotations

from pathlib import Path

from planner.plan import LayerChoice, OptimizerConfig, Plan, Stage
from profiles.model_file import file_sha256

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
MLP = ROOT / "examples" / "mlp.py"
VOCAB_GPT = ROOT / "tests" / "vocab_gpt.py"   # gpt with its embedding split by vocabulary rows
N_LAYERS = {GPT: 6, MLP: 10, VOCAB_GPT: 6}  # gpt: embedding, 4 blocks, head; mlp: input, 8 blocks, classifier


def model_ref(path: Path) -> dict:
    return {"path": str(path), "sha256": file_sha256(path), "source": "file", "name": path.stem}


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Consecutive, as even as possible, earlier stages one layer longer."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (s < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def make_plan(model: Path = GPT, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, schedule: str = "1f1b",
              b: int = 2, m: int = 1, virtual: int = 1, precision: str = "fp32", checkpoint=(), selective=(), offload=(),
              optimizer: OptimizerConfig | None = None, seed: int = 0, n_layers: int | None = None,
              sp: bool = False) -> Plan:
    n_layers = n_layers or N_LAYERS[model]
    stages = [Stage(index=s, layers=[LayerChoice(index=i, checkpoint="full" if i in checkpoint else "selective" if i in selective else "none",
                                                     offload=i in offload) for i in idx])
              for s, idx in enumerate(split_layers(n_layers, pp * virtual))]
    return Plan(profile={"path": "", "sha256": ""}, model=model_ref(model), hardware={"name": "cpu"}, device_type="cpu",
                world_size=dp * tp * pp, gpus_per_node=dp * tp * pp, dp=dp, tp=tp, pp=pp, zero=zero, schedule=schedule,
                micro_batch_size=b, num_micro_batches=m, global_batch=b * m * dp, precision=precision,
                optimizer=optimizer or OptimizerConfig(), stages=stages, seed=seed, sequence_parallel=sp)
