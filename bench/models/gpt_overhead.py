"""examples/gpt.py at a size where a CPU step takes a few hundred milliseconds, so that the
runtime's own overhead (bench/runtime_overhead.py) is measured against real work: 4 blocks
of width 256, 8 heads, 128 tokens, a 2048 vocabulary."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_gpt_example", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

gpt.VOCAB, gpt.SEQ_LEN, gpt.D_MODEL, gpt.N_HEAD, gpt.N_LAYER = 2048, 128, 256, 8, 4

build_model = gpt.build_model
make_batch = gpt.make_batch
loss_fn = gpt.loss_fn
tp_plan = gpt.tp_plan
tp_divides = [gpt.N_HEAD]
