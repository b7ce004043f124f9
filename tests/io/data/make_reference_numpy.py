"""Wrote reference_numpy.safetensors with the reference implementation (safetensors 0.8.0,
numpy 2.4.6), once, by hand; the C++ test reads the committed file and never runs this."""
import numpy as np
from safetensors.numpy import save_file
t = {
  "w.f64": np.arange(6, dtype=np.float64).reshape(2, 3) * 0.25 - 1,
  "a.f32": np.linspace(-3, 3, 7, dtype=np.float32),
  "z.f16": (np.arange(10, dtype=np.float16) / 3).reshape(5, 2),
  "i64": np.array([-5, 1 << 40, 7], dtype=np.int64),
  "i32": np.array(42, dtype=np.int32),            # rank 0
  "u16": np.array([[65535, 0, 12]], dtype=np.uint16),
  "u8": np.zeros((3, 0), dtype=np.uint8),          # zero-size
}
save_file(t, "py.safetensors", metadata={"format": "np", "who": "reference"})
for k, v in sorted(t.items()):
    print(k, list(v.shape), " ".join(repr(float(x)) for x in v.reshape(-1)))
