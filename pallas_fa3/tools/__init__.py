"""The tools around the library: the `pallas-fa3` command line (`cli`), the
benchmark harness (`bench`), the numerics studies (`numerics`) and the
deviceless sm_90a compile with its static PTX profile (`aot`). They import
the library; the library never imports them (tests/test_import_graph.py).
"""
