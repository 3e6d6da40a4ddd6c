"""Prints every rank helper of the SMP process API as one JSON line (imports no TensorFlow)."""

import json

import tfsmp as smp

smp.init()
helpers = ["rank", "size", "local_rank", "local_size", "mp_rank", "mp_size", "dp_rank",
           "dp_size", "pp_rank", "pp_size", "tp_rank", "tp_size", "rdp_rank", "rdp_size",
           "get_mp_group", "get_dp_group"]
record = {name: getattr(smp, name)() for name in helpers}
record["tensorflow_imported"] = "tensorflow" in __import__("sys").modules
print(json.dumps(record), flush=True)
smp.shutdown()
