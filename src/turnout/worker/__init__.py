"""The worker side: the app definition users write, the warm processes that run it, and the agent."""
