"""Device profiles, memory arithmetic and machine detection (numpy + onnxruntime + stdlib, like the runtime).

- `profiles`: the named DeviceProfiles (`get_profile`, `PROFILES`).
- `memory`: weights + KV + workspace within a budget -> the longest KV buffer, with the arithmetic shown.
- `detect`: what this machine is (onnxruntime providers, nvidia-smi, Jetson release files, RAM).
- `setup`: a profile applied to a bundle -> RuntimeOptions, KV length, draft length.
"""
from specdec.devices.profiles import PROFILES, DeviceProfile, get_profile, profile_names

__all__ = ["PROFILES", "DeviceProfile", "get_profile", "profile_names"]
