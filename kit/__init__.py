"""The kit's Python, one package with a subpackage per layer.

Each layer imports only from the layers before it here (tests/test_layout.py checks it):
the shared modules in this folder (the ``kit`` command, results bundle, schemas,
figures, loopback HTTP, process groups); ``geometry`` (the model's predictions);
``vllm_tree`` (pins, mods, trees, vLLM's own suites); ``weights`` (model files);
``rig`` (vLLM's real scheduler with a simulated model); ``bench`` (real servers);
``images`` (images and the container flow).
"""
