"""Deployment-side helpers shared by the Python runners. numpy only (onnx just for .pb files);
never torch or posbias_export: a server has only its runtime."""
