"""pytest plugin for safetensors' own tests: ``safetensors.torch.save_file``,
``load_file`` and ``load_model`` become fastpersist's stand-ins (``fastpersist.save_file``,
``fastpersist.load_file``, ``fastpersist.load_model``).

Loaded with ``-p safetensors_plugin`` (tools/compat on PYTHONPATH) before pytest imports
the test modules, so their ``from safetensors.torch import save_file, load_file`` get
fastpersist's functions. safetensors' ``save_model`` calls the module's ``save_file``, so
it goes through fastpersist too; ``load_model`` is fastpersist's own. ``save``/``load`` (bytes
in memory) and ``safe_open`` stay safetensors' own: fastpersist writes files only, and
the tests read fastpersist's files with stock ``safe_open``.
"""

import safetensors.torch

import fastpersist

safetensors.torch.save_file = fastpersist.save_file
safetensors.torch.load_file = fastpersist.load_file
safetensors.torch.load_model = fastpersist.load_model
