"""ZeRO: optimizer states and gradients sharded over dp (stages 1/2, ``zero.py``); parameters too (stage 3,
``fsdp.py``, gathered and freed unit by unit, ``units.py``)."""
