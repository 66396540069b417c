"""Routing traces: the ``.npz`` format (`format`), recording one from a real run (`record`),
importers from other tools (`importers`), seeded generators (`generators`), and the ``trace``
command that writes them. Used by the runtime (recording, replayed routing in tests) and by the
simulator; depends on neither."""
