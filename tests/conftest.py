"""Shared fixtures: profiles of the bundled examples, measured once per session."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def example_profiles():
    """Real (measured on this CPU) and fake profiles of examples/gpt.py and examples/mlp.py."""
    from profiles.measure import ProfileOptions, profile_model
    from profiles.model_file import load_model_file
    out = {}
    for name in ("gpt", "mlp"):
        spec = load_model_file(ROOT / "examples" / f"{name}.py")
        out[name] = {
            "spec": spec,
            "real": profile_model(spec, ProfileOptions(repeats=1, warmup=0)),
            "fake": profile_model(spec, ProfileOptions(fake=True)),
        }
    return out
