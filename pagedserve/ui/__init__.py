"""The chat UI (a Chainlit app) and the launchers `pagedserve ui` and `pagedserve up`."""
