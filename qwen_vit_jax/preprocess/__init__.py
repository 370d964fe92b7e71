"""Pixels as HF's processors make them (numpy + PIL). Read in this order:

config.py  `PreprocessConfig` and every reader of HF's processor configs (images and video, one
           reader), with each HF processor's class defaults.
images.py  Qwen's, PaddleOCR-VL's and GLM-4V's image processors: resize, rescale, normalise,
           patchify (bit for bit as HF's PIL backend).
video.py   decoding (PyAV, streaming), HF's video processors' frame sampling and sizing, timestamps.
"""
