"""How the suite names a torch dtype in ids, messages, figures and reports: ``torch.bfloat16`` -> ``"bfloat16"``.
The one owner of that spelling (torch-free: ``str(dtype)`` needs no import)."""


def dtype_name(dtype) -> str:
    """``str(dtype)`` without its ``torch.`` prefix."""
    return str(dtype).removeprefix("torch.")
