"""The exit codes of every command: 0 ok; 1 a runtime failure (data, divergence, I/O, a busy run
directory); 2 bad usage or config, before any file is written; 128+N when signal N stopped it."""

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
