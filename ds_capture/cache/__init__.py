"""The cache kinds: ``kind`` (the interface the runner drives), ``common`` (what both kinds share; imports no kind),
one package per kind (``dspark``, ``eagle3``: format, writer, reader / verify, compare, the kind), and ``registry``
(kinds by name; verify / inspect / compare of any cache directory)."""
