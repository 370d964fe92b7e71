"""Pixels as HF's processors make them (numpy + PIL). Read in this order:

config.py  `PreprocessConfig` and every reader of HF's processor configs (images and video, one
           reader), with each HF processor's class defaults.
images.py  Qwen's, PaddleOCR-VL's and GLM-4V's image processors: resize, rescale, normalise,
           patchify (bit for bit as HF's PIL backend).
video_io.py  video containers read safely (PyAV: the one file or bytes, an allow-list of
             containers), probing, decoding the sampled frames in one pass.
video.py   HF's video processors' frame sampling and sizing, timestamps, a video's plan (before a
           frame is decoded) and its patch rows a group of frames at a time.
"""
