"""Writing models out: an FP8 copy of any model quickdraft loads (``quickdraft quantize --fp8``)."""
