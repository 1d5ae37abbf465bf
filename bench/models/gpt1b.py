"""A ~1B-parameter GPT (18 blocks of width 2048, 16 heads, 1024 tokens, a 32000 vocabulary)
built from examples/gpt.py's layers, for the GPU check (bench/gpu_check.sh)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_gpt_example", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

gpt.VOCAB, gpt.SEQ_LEN, gpt.D_MODEL, gpt.N_HEAD, gpt.N_LAYER = 32000, 1024, 2048, 16, 18

build_model = gpt.build_model
make_batch = gpt.make_batch
loss_fn = gpt.loss_fn
tp_plan = gpt.tp_plan
tp_divides = [gpt.N_HEAD]
