"""The fork server's last preload (tests/launcher.py): what ranks of many tests would each import
on first use, then every object frozen out of the ranks' garbage collections."""

import gc
import importlib
import warnings

# ~1 CPU-s for transformers with the families' config classes (hf_config builds one in every rank
# that maps weight names), ~1.6 for verl's engine worker (the verl tests' ranks): paid once here,
# not by every rank. Optional extras: absent, each rank imports what its test needs as before.
OPTIONAL = ("pytest", "verl.workers.engine_workers", "verl.workers.engine")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # verl warns of every engine whose package it lacks
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:
        import transformers

        from longctx_moe.hf.families import FAMILIES

        for family in FAMILIES.values():  # transformers imports each config class on first use
            getattr(transformers, family.config_class)
    except ImportError:
        pass

# Every rank forked from the server inherits its objects (torch's, transformers' and the project's
# modules: ~500 thousand tracked ones). A full collection in a rank walks them all and writes to
# each one's header, so copy-on-write copies the pages they lie on: ~0.18 CPU-s per rank for the
# collection destroy_process_groups runs alone, more for every automatic one during the test.
# Frozen here, they stay out of the ranks' collections (Python's pattern for a pre-fork server).
gc.freeze()
