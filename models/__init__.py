"""Models trained with pallas-fa3 attention.

The GPT-style decoder and its jit-compiled training loop arrive with issue 5;
this package exists now so that the layout (and the packaging) is settled.
"""
