"""One module per `gpupool` subcommand; each exposes `register(subparsers)`."""
