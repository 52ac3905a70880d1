"""loom/imagegen.py's host side against tests/sd_numpy.py: the Euler scheduler's timesteps and
sigmas for every spacing, the timestep embedding, and the seed's noise."""
import numpy as np
import pytest

from loom import imagegen
from loom.errors import Problem

import sd_numpy as ref

CONFIG = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
          "steps_offset": 1, "prediction_type": "epsilon"}


@pytest.mark.parametrize("spacing", ["trailing", "leading", "linspace"])
@pytest.mark.parametrize("schedule", ["scaled_linear", "linear"])
@pytest.mark.parametrize("steps", [1, 4, 20, 50])
def test_scheduler_plans_as_diffusers(spacing, schedule, steps):
    cfg = dict(CONFIG, timestep_spacing=spacing, beta_schedule=schedule)
    ts, sigmas, init = imagegen.Scheduler(cfg).plan(steps)
    want_ts, want_sigmas = ref.scheduler_timesteps(steps, cfg, spacing)
    np.testing.assert_array_equal(ts, want_ts)
    np.testing.assert_allclose(sigmas, want_sigmas, rtol=1e-6)
    assert sigmas[-1] == 0 and init == pytest.approx(ref.init_noise_sigma(want_sigmas, spacing), rel=1e-6)


@pytest.mark.parametrize("cfg, message", [
    ({"beta_schedule": "squaredcos_cap_v2"}, "beta_schedule"),
    ({"prediction_type": "v_prediction"}, "epsilon only"),
    ({"timestep_spacing": "karras"}, "timestep_spacing"),
])
def test_unsupported_schedulers_refuse_clearly(cfg, message):
    with pytest.raises(Problem, match=message) as e:
        imagegen.Scheduler(dict(CONFIG, **cfg))
    assert e.value.code == "unsupported_scheduler"


@pytest.mark.parametrize("t", [999, 500, 1, 0])
@pytest.mark.parametrize("dim", [32, 320, 33])
def test_timestep_embedding(t, dim):
    # diffusers computes the frequencies in float32 (as Loom does), the reference partly in
    # float64: at t = 999 a phase of ~999 rad is itself only good to float32's 6e-5 there.
    np.testing.assert_allclose(imagegen.timestep_embedding(t, dim), ref.timestep_embedding(t, dim), atol=2e-4)


def test_noise_is_the_seeds_unit_gaussian():
    a = imagegen.noise(5, 32, 24, 4)
    assert a.shape == (32, 24, 4) and a.dtype == np.float32
    np.testing.assert_array_equal(a, imagegen.noise(5, 32, 24, 4))
    assert not np.array_equal(a, imagegen.noise(6, 32, 24, 4))
    big = imagegen.noise(2**64 - 1, 512, 512, 4).astype(np.float64)        # 1M draws
    assert abs(big.mean()) < 0.005 and abs(big.std() - 1) < 0.005
    assert abs(np.mean(big ** 4) - 3) < 0.05                 # Gaussian tails (kurtosis 3 +- 0.01), not uniform
    assert 3e-5 < (np.abs(big) > 4).mean() < 1.3e-4          # P(|z| > 4) = 6.3e-5
    assert np.isfinite(big).all()
