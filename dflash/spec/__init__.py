"""spec: what a run is asked to do. Loading ``specs/<name>.yaml`` against its JSON schema, with
did-you-mean and the cross-field rules (load.py; the schemas: schema/), the typed spec and the
fields each stage's output depends on (types.py), ``base:`` inheritance (inherit.py), sweeps
expanded into arms (sweeps.py), which specs share a store entry (sharers.py: a shared stage
names them), and ``dflash validate`` (validate.py).

May import: the top-level modules (errors, settings), artifacts/. Nothing from runtime/, models/,
decode/, data/, train/, eval/, env/ or stages/, except validate.py: a command (``dflash
validate``, dispatched by name), above every room like cli.py, it imports what it checks.
"""
