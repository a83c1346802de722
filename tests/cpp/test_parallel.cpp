// (filled in with the transports and strategies)
