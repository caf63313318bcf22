// The output_dir one run holds: its lock, and the folder its files are written through.
#pragma once

#include <memory>
#include <string>

namespace eo {

// Exclusive flocks for the life of the returned handle (the kernel drops them when the process
// dies, so a crashed run never leaves a stale lock): on output_dir itself (an fd of the folder,
// so deleting the lock file cannot let a second run in) and on output_dir/.eo-ddp.lock, which
// holds the holder's pid, host and start time for the message of the run that is refused
// (UsageError). The folder's fd stays open while the handle lives: held_output_dir writes through it.
std::shared_ptr<void> lock_output_dir(const std::string& output_dir);

// The path through which this process writes into `output_dir`: /proc/self/fd/<fd of the folder
// it locked>, so that renaming or replacing output_dir during the run cannot redirect a save into
// another folder (a second run may own the new one). A moved folder is logged once with where it
// is now. Where the file system could not lock the folder itself, the lock file must still be the
// one held (eo::Error otherwise: another run may be using the folder). `output_dir` unchanged
// when this process holds no lock on it (tools, tests) or /proc is not mounted.
std::string held_output_dir(const std::string& output_dir);

}  // namespace eo
