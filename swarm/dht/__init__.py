"""The run's shared directory in a hivemind DHT: identities, signed records and their schema, storing and
fetching them, the stage directory built from them, the signed run manifest and the settings agreement."""
