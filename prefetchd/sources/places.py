"""Where a sample's bytes lie: the codes a SampleIndex holds per sample (``kinds``) and each
source kind's row names (kinds.SourceKind.place). Apart from the index, which needs numpy, so
that checking a config (``prefetchd start``, before it hands over to the daemon) does not."""

FILE = 0  # the whole file at its path (members unused)
TAR_MEMBER = 1  # members = (byte offset, size) of the image member in the tar at its path; negative: shards._NO_IMAGE
PARQUET_ROW = 2  # members = (row group, row within it) of the Parquet file at its path
