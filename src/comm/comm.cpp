// Communicator collectives built on send_recv, for transports without native ones.
