"""Where samples come from: the sample index of every source kind, and a sample's bytes read back.

``kinds`` holds one row per ``[[source]]`` kind (its keys, how it is indexed, what reads its
samples). Image folders and file lists (``index``), WebDataset tar shards (``shards``, their
cached index ``shardcache``), Parquet image columns (``parquetsource`` indexes them,
``parquetrows`` reads them, through ``parquetpages`` and the Thrift it needs, ``thriftcompact``),
and ``samplereader``, which reads one sample's bytes whatever its kind. Used by the master (to
index) and the workers (to read); imports neither.
"""
