"""smg_operator: turns SMGWorker resources and Pods into router lifecycle calls (kopf underneath)."""

__version__ = "0.1.0"
