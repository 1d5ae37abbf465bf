"""A 7B-class GPT (LLaMA-7B sizes: 32 blocks of width 4096, 32 heads, 4096 tokens, a 32000
vocabulary) built from examples/gpt.py's layers. Meant for `plan profile --fake`: in fp32 it
would take 27 GB to build for real."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_gpt_example", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

gpt.VOCAB, gpt.SEQ_LEN, gpt.D_MODEL, gpt.N_HEAD, gpt.N_LAYER = 32000, 4096, 4096, 32, 32

build_model = gpt.build_model
make_batch = gpt.make_batch
loss_fn = gpt.loss_fn
tp_plan = gpt.tp_plan
tp_divides = [gpt.N_HEAD]
