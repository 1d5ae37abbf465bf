"""examples/gpt.py with its token embedding split by vocabulary rows under tensor parallelism
(Megatron's vocabulary-parallel embedding), for the runtime tests: each rank keeps 1/t of the
table and the embedding's output is all-reduced. (examples/gpt.py keeps its embedding whole, so
that the tests run both; the Hugging Face adapter splits it, docs/hf-models.md.)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt  # noqa: E402

build_model, make_batch, loss_fn, tp_divides = gpt.build_model, gpt.make_batch, gpt.loss_fn, gpt.tp_divides
tp_plan = {"tok": "rowwise", **gpt.tp_plan}
