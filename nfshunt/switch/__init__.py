"""One served switch: which switch a message is for, replies to their handlers, timers, the dispatcher."""
