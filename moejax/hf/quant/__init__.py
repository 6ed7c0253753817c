"""Quantised weight formats (FP8 block, INT4 pack-quantized, MXFP4): `decode` (layouts, decoders,
detection from config.json: what moejax reads) and `encode` (the encoders tests build quantised
checkpoints with). Only numpy and ml_dtypes."""
