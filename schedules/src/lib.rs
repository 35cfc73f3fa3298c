//! Pipeline schedules as pure data (see README.md beside this crate).
