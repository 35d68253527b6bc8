"""Checkpoints: the run's own, every format titanctl reads and writes, and conversion between them.

Floors, each importing only the floors below it (tests/unit/test_architecture.py checks the order):

- ``trust/``: what a checkpoint's files may be believed: paths stay inside, pickles through an
  allow-list, checksums, ``titanctl.json``, the model args and shapes they declare, the one DCP reader;
- ``quantized/``: block-quantized weights of published sources (FP8 blocks, MXFP4);
- ``hf/``: Hugging Face knowledge: names and config.json, the carried config, tokenizer files,
  what an export cannot carry, which shapes vLLM's kernels take;
- ``formats/``: one streaming source and writer per format (dcp, hf, meta, torchtune, torchtitan);
  ``locate`` decides what a path holds;
- ``lora/``: a LoRA run's base and its adapters' exports;
- ``run/``: a training run's own checkpoints (manager, state, what a run restores, its HF saves);
- ``convert`` and ``weights`` at the top: conversion, and weights for inference.
"""
