"""How the suite names a torch dtype in ids, messages, figures and reports: ``torch.bfloat16`` -> ``"bfloat16"``.
The one owner of that spelling (torch-free: ``str(dtype)`` needs no import), and of the one dtype bound the FP8
formats share (:data:`FP8_E4M3_MAX`: the KV codecs, FlashMLA's layouts and the reference's act_quant)."""

#: float8_e4m3fn's largest finite value (``torch.finfo(torch.float8_e4m3fn).max``): an FP8 scale is amax / this.
FP8_E4M3_MAX = 448.0


def dtype_name(dtype) -> str:
    """``str(dtype)`` without its ``torch.`` prefix."""
    return str(dtype).removeprefix("torch.")
