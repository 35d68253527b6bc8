"""Block-quantized weights as published sources hold them (FP8 blocks with scales, MXFP4), dequantized
when read."""
