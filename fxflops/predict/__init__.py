"""Predicted time: per op on a device, per collective on a cluster, from counted FLOPs, bytes and collectives.

A prediction is a model with a stated error, not a measurement: every constant is data with its source
(`fxflops/predict/data/`), printed by `constants()` and `fxflops explain --cluster NAME`.
`hardware` reads devices and clusters, `op_time` times ops, `comm_time` times collectives, `calibrate`
fits a device's constants from measured ops.
"""

from __future__ import annotations

from fxflops.predict.hardware import Cluster, Constant, DeviceModel, cluster, constants, device_model

__all__ = ["Cluster", "Constant", "DeviceModel", "cluster", "constants", "device_model"]
