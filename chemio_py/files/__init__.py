"""Byte-addressed files: ``ExclusiveFile`` (one private file per process), ``SharedFile``
(one file for every rank), both on ``ByteFile``; and ``RecordFile`` (variable-size records
replayed with read-ahead)."""
