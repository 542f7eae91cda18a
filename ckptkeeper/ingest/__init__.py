"""What is on disk, into the index: layout recognizers, the catalog's reconcile, the inotify watcher."""
