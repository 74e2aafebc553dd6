module opmon/client

go 1.19
